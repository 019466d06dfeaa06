"""`ContextParallel`: what `initialize` builds once for a "context_parallel" block, and the checks that run before.

    cp = build_context_parallel(section, mesh.comm(Axis.CP, ledger))
    cp.attention            the ContextAttention a model's hook installs (ring or Ulysses)
    cp.local_batch(...)     the step driver's BatchPart: this rank's tokens of a micro-batch given whole
    cp.mean_loss(sum_fn)    the model's loss: the mean over the micro-batch's valid tokens (`loss.py`)

Every cp rank is given the same full micro-batch (a loader need not know about cp). The labels in it are already
aligned with the inputs (label t is the token after input t: shifted before the split), so taking the same token
positions of inputs and labels keeps each pair, across chunk boundaries too.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.comm.collectives import Comm
from shardwise.config.schema import ContextParallelConfig, ContextParallelImpl
from shardwise.parallel.context.attention import RingAttention, UlyssesAttention
from shardwise.parallel.context.interface import ContextAttention
from shardwise.parallel.context.layout import SequenceLayout, SequenceSplitError
from shardwise.parallel.context.loss import TokenLossSum, TokenMeanLoss
from shardwise.parallel.context.ulysses import check_heads


def layout_for(section: ContextParallelConfig, rank: int, *, causal: bool = True) -> SequenceLayout:
    """The token layout of cp rank `rank`: balanced chunks for causal ring attention, contiguous parts otherwise."""
    return SequenceLayout(section.size, rank, balanced=causal and section.impl is ContextParallelImpl.RING)


def check_context_parallel(section: ContextParallelConfig, *, heads: int, kv_heads: int, seq_len: int | None,
                           attention_dropout: float) -> None:
    """One line for a model that cannot run under `section`, before any rank starts work: a sequence that does not
    cut into its chunks, heads Ulysses cannot spread, attention dropout under ring attention."""
    if section.size == 1:
        return
    if seq_len is not None:
        layout_for(section, 0).check(seq_len, what="the model's seq_len")
    if section.impl is ContextParallelImpl.ULYSSES:
        check_heads(heads, kv_heads, section.size)
    elif attention_dropout > 0:
        raise SequenceSplitError(f"attention dropout {attention_dropout} under ring attention: the ring combines "
                                 f"blocks of exact softmax; set the model's dropout to 0 or use \"impl\": \"ulysses\"")


class ContextParallel:
    """One sequence over the cp ranks of `comm`: the attention, this rank's layout, the batch split and the loss."""

    def __init__(self, section: ContextParallelConfig, comm: Comm):
        self.section = section
        self.comm = comm
        self.layout = layout_for(section, comm.rank)
        self.attention: ContextAttention = (RingAttention(comm, self.layout)
                                            if section.impl is ContextParallelImpl.RING
                                            else UlyssesAttention(comm, self.layout))

    def local_batch(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """This rank's tokens of every batch tensor with a sequence dimension ([b, S, ...] -> [b, S/C, ...]: ids,
        labels, masks); tensors of fewer dimensions (per-sample values) stay whole."""
        return tuple(self._part(x) for x in inputs), {k: self._part(v) for k, v in kwargs.items()}

    def _part(self, x: Any) -> Any:
        if not torch.is_tensor(x) or x.dim() < 2:
            return x
        return self.layout.take(x, dim=1)

    def mean_loss(self, token_loss_sum: TokenLossSum, *, ignore_index: int = -100) -> TokenMeanLoss:
        return TokenMeanLoss(token_loss_sum, self.comm, ignore_index=ignore_index)


def build_context_parallel(section: ContextParallelConfig, comm: Comm) -> ContextParallel | None:
    """The strategy of a "context_parallel" block; None when its size is 1."""
    return ContextParallel(section, comm) if section.size > 1 else None
