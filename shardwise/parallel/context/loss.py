"""The loss under context parallelism: the mean over every valid token of the micro-batch, as without cp.

Each cp rank holds part of every sequence, so it sums its own tokens' losses and counts its valid labels (those
not `ignore_index`); one all-reduce over the cp group of [sum, count] gives the micro-batch's mean on every cp rank
(a mean of per-rank means would weigh the ranks' tokens unequally when ignored labels are spread unevenly).

Gradients: rank r's parameters see only its own tokens, d(sum_r)/d(theta) / N, and the micro-batch's gradient is
the sum of those over the cp ranks. The data-parallel runtime averages gradients over its dp x cp ranks, i.e. it
divides by C more than the sum needs; so the backward here multiplies by C (Megatron scales its loss by the cp
size for the same reason). The loss value itself is not scaled.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from shardwise.comm.collectives import Comm

TokenLossSum = Callable[[Tensor, Tensor], Tensor]
"""(logits [b, s, V], labels [b, s]) -> the sum of the token losses whose label is not ignored (a 0-dim tensor)."""


class _GlobalTokenMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local_sum: Tensor, local_count: Tensor, comm: Comm) -> Tensor:
        totals = torch.stack([local_sum.detach().float(), local_count.float()])     # [2]: sum, count
        comm.all_reduce(totals)
        ctx.save_for_backward(totals[1])
        ctx.size = comm.size
        return totals[0] / totals[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (count,) = ctx.saved_tensors
        return grad * (ctx.size / count), None, None


class TokenMeanLoss:
    """`model.loss` under cp: (logits, labels) of this rank's tokens -> the micro-batch's mean token loss."""

    def __init__(self, token_loss_sum: TokenLossSum, comm: Comm, *, ignore_index: int = -100):
        self.token_loss_sum = token_loss_sum
        self.comm = comm
        self.ignore_index = ignore_index

    def __call__(self, logits: Tensor, labels: Tensor) -> Tensor:
        local_sum = self.token_loss_sum(logits, labels)
        local_count = (labels != self.ignore_index).sum()
        mean: Tensor = _GlobalTokenMean.apply(local_sum, local_count, self.comm)
        return mean
