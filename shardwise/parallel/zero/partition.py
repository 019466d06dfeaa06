"""Pure shard arithmetic for ZeRO (no torch).

Gradients and parameters are grouped into buckets (flat buffers of up to `reduce_bucket_size` elements, one
dtype and one optimizer param group each). Every bucket is padded to a multiple of the dp size and split into
equal contiguous shards, so a bucket is reduce-scattered or all-gathered with one collective:

    bucket flat buffer  [padded]            padded = round_up(numel, dp)
    rank r's shard      [r * S, (r+1) * S)  S = padded // dp

Rank r's optimizer state is the concatenation of its shards of every bucket.
"""

from __future__ import annotations

from dataclasses import dataclass


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
