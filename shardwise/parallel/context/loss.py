"""The loss under context parallelism: the mean over every valid token of the micro-batch, as without cp.

Each cp rank holds part of every sequence, so it sums its own tokens' losses and counts its valid labels (those
not `ignore_index`); one all-reduce over the cp group of [sum, count] gives the micro-batch's mean on every cp rank
(a mean of per-rank means would weigh the ranks' tokens unequally when ignored labels are spread unevenly).

Gradients: rank r's parameters see only its own tokens, d(sum_r)/d(theta) / N, and the micro-batch's gradient is
the sum of those over the cp ranks. The data-parallel runtime averages gradients over its dp x cp ranks, i.e. it
divides by C more than the sum needs; so the backward here multiplies by C (Megatron scales its loss by the cp
size for the same reason). The loss value itself is not scaled.

A caller may give the divisor instead (`total_count`): Hugging Face's Trainer passes `num_items_in_batch`, the
valid tokens of every micro-batch of the step (of all data-parallel ranks when it averages across them), and its
losses are each micro-batch's token-loss sum over that count; summed over the micro-batches, the step's gradient is
that of the mean over all its valid tokens. Under cp the sum is still all-reduced over the cp ranks (they hold parts
of the same sequences, which the count counted whole), then divided by the given count.
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
    def forward(ctx: Any, local_sum: Tensor, local_count: Tensor, comm: Comm, total_count: Tensor | None) -> Tensor:
        totals = torch.stack([local_sum.detach().float(), local_count.float()])     # [2]: sum, count
        comm.all_reduce(totals)
        count = totals[1] if total_count is None else total_count.float()
        ctx.save_for_backward(count)
        ctx.size = comm.size
        return totals[0] / count

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (count,) = ctx.saved_tensors
        return grad * (ctx.size / count), None, None, None


class TokenMeanLoss:
    """`model.loss` under cp: (logits, labels) of this rank's tokens -> the micro-batch's mean token loss."""

    def __init__(self, token_loss_sum: TokenLossSum, comm: Comm, *, ignore_index: int = -100):
        self.token_loss_sum = token_loss_sum
        self.comm = comm
        self.ignore_index = ignore_index

    def __call__(self, logits: Tensor, labels: Tensor, *, total_count: Tensor | int | None = None) -> Tensor:
        """`total_count`: divide by it instead of the micro-batch's valid tokens (see the module's docstring)."""
        local_sum = self.token_loss_sum(logits, labels)
        local_count = (labels != self.ignore_index).sum()
        given = None if total_count is None else torch.as_tensor(total_count, device=local_sum.device)
        mean: Tensor = _GlobalTokenMean.apply(local_sum, local_count, self.comm, given)
        return mean
