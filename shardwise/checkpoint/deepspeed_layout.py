"""DeepSpeed's ZeRO flat layouts, as pure arithmetic: where each element of a parameter group sits in the
per-rank tensors DeepSpeed's optimizer files hold. Both directions use it: reading a DeepSpeed checkpoint
(`deepspeed_read.py`) and writing ours so that DeepSpeed reads it (`deepspeed_write.py`).

ZeRO-1/2 (`single_partition_of_fp32_groups`, one flat tensor per param group and rank): the group's parameters
flattened one after another in group order (each followed by its alignment padding, zero unless
`parameter_alignment`), the whole padded to a multiple of 2 x dp and cut into dp equal partitions; rank r holds
partition r. A parameter may straddle partitions.

ZeRO-3 (`fp32_flat_groups`, one flat tensor per sub-group and rank): every parameter is cut on its own into dp
pieces of ceil(numel / dp) elements (the last padded); rank r's flat tensor is its piece of each parameter of
the sub-group, one after another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

ALIGNMENT_FACTOR = 2
"""DeepSpeed's `nccl_start_alignment_factor`: a ZeRO-1/2 group is padded to a multiple of 2 x dp elements."""


@dataclass(frozen=True)
class Run:
    """Elements [lo, hi) of a parameter, flattened, are elements [dst, dst + hi - lo) of rank `rank`'s flat
    tensor of one group."""

    rank: int
    lo: int
    hi: int
    dst: int


def zero12_partition_numel(numels: Sequence[int], paddings: Sequence[int], dp: int) -> int:
    """The size of each rank's partition of a ZeRO-1/2 group of parameters with `numels` elements."""
    total = sum(numels) + sum(paddings)
    align = ALIGNMENT_FACTOR * dp
    return math.ceil(total / align) * align // dp


def zero12_runs(numels: Sequence[int], paddings: Sequence[int], dp: int) -> list[list[Run]]:
    """Per parameter of a ZeRO-1/2 group, the runs of it each rank holds."""
    part = zero12_partition_numel(numels, paddings, dp)
    out: list[list[Run]] = []
    offset = 0
    for numel, pad in zip(numels, paddings):
        runs = []
        for rank in range(offset // part if part else 0, dp):
            a, b = max(offset, rank * part), min(offset + numel, (rank + 1) * part)
            if a >= b:
                break
            runs.append(Run(rank, a - offset, b - offset, a - rank * part))
        out.append(runs)
        offset += numel + pad
    return out


def zero3_piece_numel(numel: int, dp: int) -> int:
    """The size of each rank's piece of one ZeRO-3 parameter (the last rank's padded)."""
    return math.ceil(numel / dp)


def zero3_runs(numels: Sequence[int], dp: int) -> list[list[Run]]:
    """Per parameter of a ZeRO-3 sub-group, the runs of it each rank holds (padding excluded)."""
    out: list[list[Run]] = []
    offset = 0
    for numel in numels:
        piece = zero3_piece_numel(numel, dp)
        out.append([Run(rank, rank * piece, min(numel, (rank + 1) * piece), offset)
                    for rank in range(dp) if rank * piece < numel])
        offset += piece
    return out


def zero3_flat_numel(numels: Sequence[int], dp: int) -> int:
    """The size of each rank's flat tensor of a ZeRO-3 sub-group."""
    return sum(zero3_piece_numel(n, dp) for n in numels)
