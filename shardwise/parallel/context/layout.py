"""Which tokens of a sequence each context-parallel rank holds: pure arithmetic over the sequence dimension.

Ring attention under a causal mask cuts the sequence into 2C equal chunks and gives rank i chunks i and 2C-1-i
(an early chunk, whose queries see few keys, beside a late one, which sees many), so every rank does the same
attention work. Without that balancing (Ulysses, or a mask that is not causal) rank i holds the i-th of C
contiguous parts.

    C = 2, S = 8, balanced:   chunks 0 1 2 3 (2 tokens each);  rank 0 holds chunks 0, 3 = tokens 0 1 6 7,
                              rank 1 holds chunks 1, 2 = tokens 2 3 4 5
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shardwise.errors import UserError


class SequenceSplitError(UserError, ValueError):
    """A sequence, or a head count, that does not split over the context-parallel ranks."""


@dataclass(frozen=True)
class SequenceLayout:
    """This rank's part of every sequence: `size` ranks, this one `rank`; `balanced`: two chunks of 2 * size."""

    size: int
    rank: int
    balanced: bool

    @property
    def chunks(self) -> int:
        """Equal pieces the sequence is cut into."""
        return 2 * self.size if self.balanced else self.size

    def check(self, seq_len: int, *, what: str = "sequence length") -> None:
        """One line when `seq_len` does not cut into `chunks` equal pieces."""
        if seq_len % self.chunks:
            why = (f"2 * context_parallel.size = {self.chunks} chunks (causal ring attention gives rank i chunks i "
                   f"and {self.chunks - 1}-i)" if self.balanced else f"context_parallel.size = {self.size} parts")
            raise SequenceSplitError(f"{what} {seq_len} does not cut into {why}; use a {what} that is a multiple of "
                                     f"{self.chunks} (pad the batch) or another context_parallel.size")

    def spans(self, seq_len: int) -> list[tuple[int, int]]:
        """This rank's token ranges [start, stop), in the order it holds them."""
        self.check(seq_len)
        piece = seq_len // self.chunks
        if not self.balanced:
            return [(self.rank * piece, (self.rank + 1) * piece)]
        late = self.chunks - 1 - self.rank
        return [(self.rank * piece, (self.rank + 1) * piece), (late * piece, (late + 1) * piece)]

    def take(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of `x` along `dim` (the whole sequence): [.., S, ..] -> [.., S / size, ..]. Views of
        contiguous ranges (no index tensor, nothing read back to the host)."""
        parts = [x.narrow(dim, start, stop - start) for start, stop in self.spans(x.shape[dim])]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def positions(self, local_len: int, device: torch.device) -> Tensor:
        """The positions in the whole sequence of this rank's `local_len` tokens, in local order: [local_len]
        int64. What learned position tables and rotary angles read instead of arange(local_len)."""
        ranges = [torch.arange(start, stop, device=device) for start, stop in self.spans(local_len * self.size)]
        return ranges[0] if len(ranges) == 1 else torch.cat(ranges)
