"""RowLayout: each rank holds dim-0 rows of every parameter (FSDP2's chunks); the gathered rank-major buffer copies
out to the parameters, gradients add into rank-major order, both equal to slicing the full tensors."""

import torch
from hypothesis import given, settings, strategies as st

from shardwise.parallel.zero.partition import RowLayout

SHAPES = st.lists(st.one_of(st.just(()), st.tuples(st.integers(0, 9)), st.tuples(st.integers(0, 9), st.integers(1, 3)),
                            st.tuples(st.integers(1, 5), st.integers(1, 2), st.integers(1, 3))), min_size=1, max_size=5)


def test_row_layout_golden():
    layout = RowLayout(((5, 2), (3,), ()), dp_size=2)       # R = 3, 2, 1 rows per rank
    assert layout.chunks == (6, 2, 1) and layout.shard_numel == 9 and layout.offsets == (0, 12, 16)
    assert [layout.local_shape(i, 0) for i in range(3)] == [(3, 2), (2,), ()]
    assert [layout.local_shape(i, 1) for i in range(3)] == [(2, 2), (1,), (0,)]
    assert layout.pieces_in_shard(1) == [(0, 6, 10, 0), (1, 2, 3, 6)]
    assert RowLayout(((1, 4),), dp_size=4).local_shape(0, 3) == (0, 4)


@settings(max_examples=40, deadline=None)
@given(SHAPES, st.integers(1, 5))
def test_rows_gather_and_reduce_like_slicing(shapes, dp):
    layout = RowLayout(tuple(shapes), dp)
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in shapes]
    shards = torch.zeros(dp, layout.shard_numel)
    for r in range(dp):
        for i, lo, hi, at in layout.pieces_in_shard(r):
            shards[r, at:at + hi - lo] = values[i].reshape(-1)[lo:hi]
            rows = values[i].reshape(-1)[lo:hi].view(layout.local_shape(i, r))
            expected = values[i].chunk(dp)[r] if shapes[i] else values[i]       # torch.chunk: FSDP2's rows
            assert torch.equal(rows, expected)
    full = torch.full((layout.padded_numel,), float("nan"))
    layout.copy_out(shards.reshape(-1), full)
    for i, (o, n) in enumerate(zip(layout.offsets, layout.sizes)):
        assert torch.equal(full[o:o + n].view(shapes[i]), values[i])
    buf = torch.zeros(layout.padded_numel)
    for i, v in enumerate(values):
        layout.add_grad(buf, i, v)
        layout.add_grad(buf, i, v)                            # accumulates
    assert torch.equal(buf.view(dp, -1), 2 * shards)


def test_row_copies_benchmark_runs(capsys):
    from benchmarks.row_copies import main
    assert main(["--model", "tiny", "--world", "3", "--iters", "2"]) == 0
    out = capsys.readouterr().out
    assert "RowLayout.copy_out" in out and "RowLayout.add_grad" in out and "3 ranks" in out


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 2)), min_size=1, max_size=4),
       st.integers(1, 3), st.data())
def test_rows_along_another_dim(sizes, dp, data):
    """FSDP2's Shard(k), k > 0 (an even cut): each rank's piece is torch.chunk along k, stored contiguous; the
    gather copies out to the whole parameters, gradients add into each rank's piece. Mixed with dim-0 cuts."""
    dims = [data.draw(st.integers(0, 2)) for _ in sizes]
    # the cut dim a multiple of dp (even), the others as drawn
    shapes = [tuple(n * dp if j == k else n for j, n in enumerate(size)) for size, k in zip(sizes, dims)]
    layout = RowLayout.of_shapes(shapes, dp, tuple(dims))
    gen = torch.Generator().manual_seed(1)
    values = [torch.randn(s, generator=gen) for s in shapes]
    shards = torch.zeros(dp, layout.shard_numel)
    for r in range(dp):
        for i, lo, hi, at in layout.pieces_in_shard(r):
            piece = layout.piece_of(i, r, values[i])
            assert torch.equal(piece, values[i].chunk(dp, dims[i])[r]), (i, r)
            assert tuple(piece.shape) == layout.local_shape(i, r) and hi - lo == piece.numel()
            shards[r, at:at + hi - lo] = piece.reshape(-1)
    full = torch.full((layout.padded_numel,), float("nan"))
    layout.copy_out(shards.reshape(-1), full)
    for i, (o, n) in enumerate(zip(layout.offsets, layout.sizes)):
        assert torch.equal(full[o:o + n].view(shapes[i]), values[i])
    buf = torch.zeros(layout.padded_numel)
    for i, v in enumerate(values):
        layout.add_grad(buf, i, v)
        layout.add_grad(buf, i, v)
    assert torch.equal(buf.view(dp, -1), 2 * shards)
