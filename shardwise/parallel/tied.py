"""Parameters that several ranks of one model hold as equal copies: weights tied across pipeline stages (a
GPT-2 embedding reused as the output projection on the last stage).

Each stage holding a copy computes only its own uses' part of the gradient. Before the update the copies sum the
parts over `comm` (the ranks of the sharing stages with this rank's dp and tp coordinates), so all copies take the
same step and stay equal. In the global gradient norm the weight counts once: only the `counted` copy (the first
sharing stage's) adds its square. An update strategy turns `TiedParams` into `TiedSlot`s: which of its stepped tensors is the
copy (the strategy keeps each tied parameter in a stepped tensor of its own, identical on every sharing stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from shardwise.comm.collectives import Comm


@dataclass(frozen=True)
class TiedParam:
    param: torch.nn.Parameter
    comm: Comm
    """This rank and the other ranks holding a copy of the weight (one per holding stage, same dp and tp coordinates)."""
    counted: bool
    """Whether this copy counts in the global gradient norm (the first sharing stage's does, the others' do not)."""


@dataclass(frozen=True)
class TiedParams:
    """This rank's tied copies, in one order agreed by every rank (tie key, then attribute): each rank issues
    the sums of overlapping groups in that order, so no two ranks wait on each other's group."""

    entries: tuple[TiedParam, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)

    def ids(self) -> set[int]:
        return {id(t.param) for t in self.entries}

    def slots(self, stepped_index: dict[int, int]) -> list["TiedSlot"]:
        """`stepped_index`: id(parameter) -> index of the stepped tensor that holds exactly that parameter. A
        frozen weight is stepped nowhere (every copy leaves it out alike)."""
        return [TiedSlot(stepped_index[id(t.param)], t.comm, t.counted) for t in self.entries
                if id(t.param) in stepped_index]


@dataclass(frozen=True)
class TiedSlot:
    index: int
    """The stepped tensor (whole parameter, or a bucket shard of it alone) whose `.grad` is summed."""
    comm: Comm
    counted: bool


def sum_tied_grads(stepped: Sequence[torch.Tensor], slots: Sequence[TiedSlot]) -> None:
    """Sum each tied copy's gradient over the ranks holding copies, in place (each then has the whole gradient).
    A copy without a gradient contributes zeros, so every copy still meets the others in the collective."""
    for slot in slots:
        p = stepped[slot.index]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        slot.comm.all_reduce(p.grad)


def uncounted(slots: Sequence[TiedSlot]) -> frozenset[int]:
    """The stepped tensors this rank leaves out of the global norm: copies another stage's copy counts."""
    return frozenset(s.index for s in slots if not s.counted)
