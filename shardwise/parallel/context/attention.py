"""The two `ContextAttention` implementations, and the attention-core module a model's hook installs."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.comm.collectives import Comm
from shardwise.parallel.context.interface import ContextAttention
from shardwise.parallel.context.layout import SequenceLayout
from shardwise.parallel.context.ring import ring_attention
from shardwise.parallel.context.ulysses import ulysses_attention


@dataclass(frozen=True, eq=False)
class RingAttention:
    """Keys and values passed round the cp ranks (`ring.py`); `layout` balanced for causal attention."""

    comm: Comm
    layout: SequenceLayout

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor:
        return ring_attention(q, k, v, comm=self.comm, layout=self.layout, causal=causal)


def grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor:
    """torch's SDPA with key/value heads [B, Hkv, S, D] repeated to the query heads [B, H, S, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@dataclass(frozen=True, eq=False)
class UlyssesAttention:
    """All-to-all to whole heads, SDPA, all-to-all back (`ulysses.py`); `layout` contiguous."""

    comm: Comm
    layout: SequenceLayout

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor:
        return ulysses_attention(q, k, v, comm=self.comm,
                                 local=lambda q_, k_, v_: grouped_sdpa(q_, k_, v_, causal=causal))


class ContextParallelCore(nn.Module):
    """A causal attention core [B, H, s, D] x [B, Hkv, s, D] x [B, Hkv, s, D] -> [B, H, s, D] over this rank's
    part of the sequence: what a model's context-parallel hook puts in place of its own core. No parameters;
    selective recomputation recomputes it like the core it replaces (its collectives then run again, in the
    same order on every rank)."""

    is_attention_core = True

    def __init__(self, attention: ContextAttention):
        super().__init__()
        self.attention = attention

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.attention(q, k, v, causal=True)
