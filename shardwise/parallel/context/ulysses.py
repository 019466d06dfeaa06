"""Ulysses: attention over whole heads. Each cp rank holds a contiguous 1/C of the sequence for every head; an
all-to-all turns that into the whole sequence for 1/C of the heads, ordinary attention runs there, and the inverse
all-to-all turns the output back.

    q [B, H, S/C, D]  --seq_to_heads-->  [B, H/C, S, D]  --attention-->  [B, H/C, S, D]  --heads_to_seq-->  [B, H, S/C, D]

Rank c receives heads [c H/C, (c+1) H/C). Grouped-query key/value heads go the same way when C divides their
count; with fewer key/value heads than ranks each is first repeated C / Hkv times (rank c then holds the copy of
head c // (C / Hkv), the one its query heads use), so C must divide or be a multiple of Hkv.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from shardwise.comm.collectives import Comm
from shardwise.parallel.context.layout import SequenceSplitError


def _all_to_all(x: Tensor, comm: Comm) -> Tensor:
    """x [C, ...]: slice j goes to group rank j; the result's slice j came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x)
    return out


def _seq_to_heads(x: Tensor, comm: Comm) -> Tensor:
    """[B, H, s, D] (this rank's sequence part, every head) -> [B, H/C, C*s, D] (every part, this rank's heads)."""
    c = comm.size
    b, h, s, d = x.shape
    parts = x.reshape(b, c, h // c, s, d).transpose(0, 1)            # [C, B, H/C, s, D]: head group j for rank j
    gathered = _all_to_all(parts, comm)                             # [C, B, H/C, s, D]: sequence part j from rank j
    return gathered.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def _heads_to_seq(y: Tensor, comm: Comm) -> Tensor:
    """The inverse: [B, H/C, C*s, D] -> [B, H, s, D]."""
    c = comm.size
    b, hc, cs, d = y.shape
    parts = y.reshape(b, hc, c, cs // c, d).permute(2, 0, 1, 3, 4)      # [C, B, H/C, s, D]: sequence part j for rank j
    gathered = _all_to_all(parts, comm)                             # [C, B, H/C, s, D]: head group j from rank j
    return gathered.transpose(0, 1).reshape(b, c * hc, cs // c, d)


class SeqToHeads(torch.autograd.Function):
    """`_seq_to_heads` going forward, its inverse on the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return _seq_to_heads(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _heads_to_seq(grad, ctx.comm), None


class HeadsToSeq(torch.autograd.Function):
    """`_heads_to_seq` going forward, its inverse on the gradient."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return _heads_to_seq(y, comm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _seq_to_heads(grad, ctx.comm), None


def check_heads(heads: int, kv_heads: int, size: int) -> None:
    """One line when `heads` query or `kv_heads` key/value heads do not spread over `size` Ulysses ranks."""
    if heads % size:
        raise SequenceSplitError(f"attention heads {heads} are not divisible by context_parallel.size = {size} "
                                 f"(Ulysses gives each rank whole heads); use a size dividing {heads} or "
                                 f'"impl": "ring"')
    if kv_heads % size and size % kv_heads:
        raise SequenceSplitError(f"key/value heads {kv_heads} neither divide nor are divisible by "
                                 f"context_parallel.size = {size} (Ulysses gives each rank whole key/value heads, "
                                 f'repeated when fewer than the ranks); use a size dividing {kv_heads} or "impl": "ring"')


def kv_for_ranks(x: Tensor, size: int) -> Tensor:
    """Key/value heads [B, Hkv, s, D] as the all-to-all spreads them: repeated C / Hkv times when fewer than C."""
    kv_heads = x.shape[1]
    return x if kv_heads % size == 0 else x.repeat_interleave(size // kv_heads, dim=1)


LocalAttention = Callable[[Tensor, Tensor, Tensor], Tensor]
"""Attention of whole heads over the whole sequence: q [B, h, S, D], k, v [B, hkv, S, D] -> [B, h, S, D]."""


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, *, comm: Comm, local: LocalAttention) -> Tensor:
    """This rank's output [B, H, s, D] for its sequence part q [B, H, s, D], k, v [B, Hkv, s, D]."""
    check_heads(q.shape[1], k.shape[1], comm.size)
    k, v = kv_for_ranks(k, comm.size), kv_for_ranks(v, comm.size)
    heads: Tensor = local(SeqToHeads.apply(q, comm), SeqToHeads.apply(k, comm), SeqToHeads.apply(v, comm))
    out: Tensor = HeadsToSeq.apply(heads, comm)
    return out
