"""Shard arithmetic for ZeRO, and the copies a layout needs between its gathered buffer and its parameters.

Gradients and parameters are grouped into buckets (flat buffers of up to `reduce_bucket_size` elements, one
dtype and one optimizer param group each). Every bucket is padded to a multiple of the dp size and split into
equal contiguous shards, so a bucket is reduce-scattered or all-gathered with one collective:

    bucket flat buffer  [padded]            padded = round_up(numel, dp)
    rank r's shard      [r * S, (r+1) * S)  S = padded // dp

Rank r's optimizer state is the concatenation of its shards of every bucket.

Two layouts answer the same questions (`offsets` of each parameter in the gathered full buffer, `pieces_in_shard`,
`local_shape`, `copy_out`, `add_grad`): `FlatLayout`, the engine's (contiguous element ranges: its checkpoint
format depends on it; the all-gather lands in the full buffer as it is), and `RowLayout`, the module wrappers'
(dim-0 rows of each parameter, as FSDP2's).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(n: int, multiple: int) -> int:
    return ceil_div(n, multiple) * multiple


@dataclass(frozen=True)
class ShardRange:
    start: int
    stop: int          # half-open range into the padded flat buffer

    @property
    def numel(self) -> int:
        return self.stop - self.start


def shard_flat_buffer(numel: int, dp_size: int, *, align: int = 1) -> tuple[int, list[ShardRange]]:
    """Equal contiguous shards of a flat buffer; returns the padded length and each rank's range."""
    if dp_size < 1 or numel < 0:
        raise ValueError(f"shard_flat_buffer: numel {numel} must be >= 0 and dp_size {dp_size} >= 1")
    per_rank = round_up(ceil_div(numel, dp_size), align) if numel else 0
    return per_rank * dp_size, [ShardRange(r * per_rank, (r + 1) * per_rank) for r in range(dp_size)]


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a bucket lives in its flat buffer, and how the buffer is sharded."""

    sizes: tuple[int, ...]        # numel of each parameter, in bucket order
    dp_size: int

    gathers_in_place = True       # the all-gather's rank-major output is the full buffer: no copy_out

    @classmethod
    def of_shapes(cls, shapes, dp_size: int) -> "FlatLayout":
        return cls(tuple(_prod(tuple(s)) for s in shapes), dp_size)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, off = [], 0
        for n in self.sizes:
            out.append(off)
            off += n
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def padded_numel(self) -> int:
        return shard_flat_buffer(self.numel, self.dp_size)[0]

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.dp_size

    def shard(self, rank: int) -> ShardRange:
        return shard_flat_buffer(self.numel, self.dp_size)[1][rank]

    def pieces_in_shard(self, rank: int) -> list[tuple[int, int, int, int]]:
        """The parts of parameters that fall in `rank`'s shard: (param index, start in the param's flat
        view, stop, start in the shard)."""
        shard = self.shard(rank)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.sizes)):
            lo, hi = max(off, shard.start), min(off + n, shard.stop)
            if lo < hi:
                out.append((i, lo - off, hi - off, lo - shard.start))
        return out

    def local_shape(self, i: int, rank: int) -> tuple[int, ...]:
        """Parameter i's piece on `rank`: 1-D, [0] when it has none there."""
        return next(((hi - lo,) for j, lo, hi, _ in self.pieces_in_shard(rank) if j == i), (0,))

    def copy_out(self, gathered, full) -> None:
        full.copy_(gathered)

    def add_grad(self, buf, i: int, grad) -> None:
        """Add parameter i's full gradient into the reduce-scatter input buf [padded] (its flat range)."""
        off, n = self.offsets[i], self.sizes[i]
        buf[off:off + n].add_(grad.reshape(-1))


def _prod(dims: tuple[int, ...]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


@dataclass(frozen=True)
class RowLayout:
    """A unit's buffer sharded by dim-0 rows of each parameter, as FSDP2 shards (the module wrappers' layout).

    Parameter i of shape [d_i, *rest_i] (rows of c_i = prod(rest_i) elements; a 0-dim parameter is one row of one
    element) is cut into chunks of R_i = ceil(d_i / W) rows: rank r holds rows [r R_i, min((r+1) R_i, d_i)),
    possibly none. Rank r's shard is its chunk of every parameter in order, each padded to R_i rows:

        shard r      [S]        S = sum_i R_i c_i; parameter i at shard offset s_i = sum_{j<i} R_j c_j
        all-gather   [W, S]     rank-major: row r is rank r's shard
        full         [W S]      parameter-major: parameter i at W s_i, as [W, R_i c_i] (its rows, then padding)

    The gather lands rank-major; `copy_out` turns it into the parameter-major buffer the parameters view (one
    split-copy for the whole unit). A gradient is added straight into the rank-major reduce-scatter input by
    `add_grad` (two strided adds per parameter, no separate copy-in pass).

    `dims[i]` = k > 0 (FSDP2's `shard_placement_fn` returning Shard(k)) cuts parameter i along dim k instead,
    evenly (W divides its size there): rank r holds the slice [..., r R_i : (r+1) R_i, ...] of dim k, stored
    contiguous in that shape, so "rows" above are its slices along dim k. `copy_out` and `add_grad` then move
    the rank axis to dim k (one more copy of that parameter each)."""

    shapes: tuple[tuple[int, ...], ...]
    dp_size: int
    dims: tuple[int, ...] = ()
    """Per parameter, the dim it is cut along (empty: dim 0 for all)."""

    gathers_in_place = False

    @classmethod
    def of_shapes(cls, shapes, dp_size: int, dims: tuple[int, ...] = ()) -> "RowLayout":
        shapes = tuple(tuple(s) for s in shapes)
        dims = tuple(dims) if any(dims) else ()
        for i, k in enumerate(dims):
            if k and shapes[i][k] % dp_size:
                raise ValueError(f"parameter {i} of shape {shapes[i]} cut along dim {k}: {dp_size} ranks must "
                                 f"divide its size there")
        return cls(shapes, dp_size, dims)

    def dim(self, i: int) -> int:
        return self.dims[i] if self.dims else 0

    def rows(self, i: int) -> int:
        return self.shapes[i][self.dim(i)] if self.shapes[i] else 1

    def row_numel(self, i: int) -> int:
        k = self.dim(i)
        return _prod(self.shapes[i][:k] + self.shapes[i][k + 1:])

    @cached_property
    def rows_per_rank(self) -> tuple[int, ...]:
        return tuple(ceil_div(self.rows(i), self.dp_size) for i in range(len(self.shapes)))

    @cached_property
    def chunks(self) -> tuple[int, ...]:
        """R_i c_i: the elements of parameter i in every rank's shard, padding included."""
        return tuple(r * self.row_numel(i) for i, r in enumerate(self.rows_per_rank))

    @cached_property
    def shard_offsets(self) -> tuple[int, ...]:
        return tuple(sum(self.chunks[:i]) for i in range(len(self.chunks)))

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(_prod(s) for s in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where parameter i starts in the parameter-major full buffer."""
        return tuple(self.dp_size * s for s in self.shard_offsets)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def shard_numel(self) -> int:
        return sum(self.chunks)

    @property
    def padded_numel(self) -> int:
        return self.dp_size * self.shard_numel

    def local_rows(self, i: int, rank: int) -> int:
        per = self.rows_per_rank[i]
        return max(0, min(per, self.rows(i) - rank * per))

    def local_shape(self, i: int, rank: int) -> tuple[int, ...]:
        """Parameter i's rows on `rank`: [rows, *rest]. A 0-dim parameter lives on rank 0 (shape []) and is an
        empty [0] on the other ranks."""
        rows = self.local_rows(i, rank)
        if not self.shapes[i]:
            return () if rows else (0,)
        k = self.dim(i)
        return (*self.shapes[i][:k], rows, *self.shapes[i][k + 1:])

    def piece_of(self, i: int, rank: int, full: torch.Tensor) -> torch.Tensor:
        """Rank `rank`'s piece of parameter i's whole value `full` [shapes[i]], shaped `local_shape` (a view;
        not contiguous when the parameter is cut along a dim other than 0)."""
        k, per = self.dim(i), self.rows_per_rank[i]
        if k == 0:
            lo = min(rank * per, self.rows(i)) * self.row_numel(i)
            return full.reshape(-1)[lo:lo + _prod(self.local_shape(i, rank))].view(self.local_shape(i, rank))
        return full.view(self.shapes[i]).narrow(k, rank * per, per)

    def pieces_in_shard(self, rank: int) -> list[tuple[int, int, int, int]]:
        """(param index, start in the param's flat view, stop, start in the shard) of the rows `rank` holds."""
        out = []
        for i, (per, c, at) in enumerate(zip(self.rows_per_rank, map(self.row_numel, range(len(self.shapes))),
                                             self.shard_offsets)):
            rows = self.local_rows(i, rank)
            if rows:
                out.append((i, rank * per * c, (rank * per + rows) * c, at))
        return out

    def copy_out(self, gathered, full) -> None:
        """Rank-major gathered [W S] -> parameter-major full [W S]: parameter i's [W, R_i c_i] block is column
        block i of the [W, S] view, so one split-copy moves the whole unit."""
        w = self.dp_size
        outs = [full[o:o + w * c].view(w, c) for o, c in zip(self.offsets, self.chunks)]
        torch.split_with_sizes_copy(gathered.view(w, self.shard_numel), list(self.chunks), dim=1, out=outs)
        for i, k in enumerate(self.dims):
            if k:       # [W, *local] rank slices -> the rank axis moved to dim k: [*shape]
                moved = outs[i].view(w, *self.local_shape(i, 0)).movedim(0, k)
                if not moved.is_contiguous():       # else (sizes of 1) the order is already the parameter's
                    outs[i].view(self.shapes[i]).copy_(moved.contiguous().view(self.shapes[i]))

    def add_grad(self, buf, i: int, grad) -> None:
        """Add parameter i's full gradient (its shape) into the rank-major reduce-scatter input buf [W S]: ranks
        holding R_i rows take one [q, R_i c_i] strided add, a last partial rank the remaining rows."""
        per, c, at = self.rows_per_rank[i], self.row_numel(i), self.shard_offsets[i]
        if per == 0 or c == 0:
            return
        w, rows = self.dp_size, self.rows(i)
        block = buf.view(w, self.shard_numel)[:, at:at + per * c]          # [W, R_i c_i]
        k = self.dim(i)
        if k:           # [*shape] viewed [..., W, R_i, ...] at dim k, the rank axis moved first: [W, *local]
            shape = self.shapes[i]
            split = grad.reshape(*shape[:k], w, per, *shape[k + 1:]).movedim(k, 0)
            block.view(w, *self.local_shape(i, 0)).add_(split)
            return
        g = grad.reshape(-1)                                                 # [d_i c_i]
        whole = rows // per
        block[:whole].add_(g[:whole * per * c].view(whole, per * c))
        if whole * per < rows:
            block[whole, :(rows - whole * per) * c].add_(g[whole * per * c:])
