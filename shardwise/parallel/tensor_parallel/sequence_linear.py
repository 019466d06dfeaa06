"""Column-parallel linears on sequence-parallel inputs that keep only the sequence shard for backward.

Under sequence parallelism a column-parallel linear (q/k/v, the MLP's first layer, the lm-head) multiplies the
all-gathered input [b, s, h] of the [b, s/t, h] shards. A plain `F.linear` saves what it multiplies, so every TP
rank would keep the whole [b, s, h] for the weight gradient: 2 s b h e (1 - 1/t) bytes per layer more than
needed. As Megatron-LM does, `linear_on_gathered` saves this rank's shard instead and gathers it again in
backward, once for all the linears that share one gathered input (`Regather` counts them and drops the gathered
copy after the last one's backward). The forward and the gradients are the same arithmetic as `F.linear`'s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from shardwise.comm.collectives import Comm
from shardwise.parallel.tensor_parallel.mappings import all_gather

REGATHER_ATTR = "_shardwise_regather"
"""Set on an all-gathered input: (this rank's shard, its `Regather`), for the linears that consume it."""


class Regather:
    """One all-gathered input shared by several linears: gathered again in backward by the first of them that
    needs it, kept for the others, dropped after the last. Holds no tensor between forward and backward (the
    shard is saved by each linear, so activation recomputation can replace it)."""

    def __init__(self, comm: Comm, dim: int):
        self.comm, self.dim = comm, dim
        self.users = 0
        self._full: Tensor | None = None

    def full(self, shard: Tensor) -> Tensor:
        if self._full is None:
            self._full = all_gather(shard, self.comm, self.dim)
        return self._full

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self._full = None


def mark_gathered(full: Tensor, shard: Tensor, comm: Comm, dim: int) -> Tensor:
    """Note on `full` (the all-gather of `shard` along `dim`) how to gather it again in backward."""
    setattr(full, REGATHER_ATTR, (shard.detach(), Regather(comm, dim)))
    return full


class _LinearOnGathered(torch.autograd.Function):
    """y = full W^T + b with full [.., in] the gather of `shard`; saves the shard, not `full`."""

    @staticmethod
    def forward(ctx: Any, full: Tensor, shard: Tensor, weight: Tensor, bias: Tensor | None,
                regather: Regather) -> Tensor:
        regather.users += 1
        ctx.regather, ctx.has_bias = regather, bias is not None
        ctx.save_for_backward(shard, weight)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        shard, weight = ctx.saved_tensors
        grad_full = grad.matmul(weight) if ctx.needs_input_grad[0] else None        # [.., in]
        grad_w = grad_b = None
        if ctx.needs_input_grad[2] or (ctx.has_bias and ctx.needs_input_grad[3]):
            g2 = grad.reshape(-1, grad.shape[-1])                                   # [tokens, out/t]
            if ctx.needs_input_grad[2]:
                full = ctx.regather.full(shard)
                grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1]))             # [out/t, in]
            if ctx.has_bias and ctx.needs_input_grad[3]:
                grad_b = g2.sum(0)
        ctx.regather.release()
        return grad_full, None, grad_w, grad_b, None


def linear_on_gathered(full: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`F.linear(full, weight, bias)`, keeping the shard `full` was gathered from when it says so."""
    noted = getattr(full, REGATHER_ATTR, None)
    if noted is None or not torch.is_grad_enabled():
        return F.linear(full, weight, bias)
    shard, regather = noted
    return _LinearOnGathered.apply(full, shard, weight, bias, regather)
