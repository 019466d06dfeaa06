from hypothesis import given, strategies as st

from shardwise.parallel.zero.partition import FlatLayout, shard_flat_buffer


def test_shard_flat_buffer_golden():
    padded, ranges = shard_flat_buffer(10, 4)
    assert padded == 12 and [(r.start, r.stop) for r in ranges] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert shard_flat_buffer(0, 3)[0] == 0
    assert shard_flat_buffer(5, 2, align=4)[0] == 8


def test_pieces_in_shard_golden():
    layout = FlatLayout((3, 4, 2), dp_size=2)        # numel 9 -> padded 10, shards [0,5) [5,10)
    assert layout.pieces_in_shard(0) == [(0, 0, 3, 0), (1, 0, 2, 3)]
    assert layout.pieces_in_shard(1) == [(1, 2, 4, 0), (2, 0, 2, 2)]


@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 8))
def test_shards_cover_every_element_once(sizes, dp):
    layout = FlatLayout(tuple(sizes), dp)
    assert layout.padded_numel % dp == 0 and layout.padded_numel - layout.numel < dp
    covered = [0] * layout.numel
    for r in range(dp):
        for i, lo, hi, at in layout.pieces_in_shard(r):
            assert 0 <= at and at + (hi - lo) <= layout.shard_numel
            for k in range(lo, hi):
                covered[layout.offsets[i] + k] += 1
    assert covered == [1] * layout.numel
