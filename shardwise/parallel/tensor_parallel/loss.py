"""Cross-entropy over vocabulary-sharded logits, without ever gathering the full logits.

    loss = vocab_parallel_cross_entropy(local_logits, labels, tp_comm)   # [b, s, V/t], [b, s] -> scalar

Two small collectives of N = b * s elements, against b * s * V for gathering the logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from shardwise.comm.collectives import Comm

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Rank r holds logits z[:, r V/t : (r+1) V/t]. For each token n with label y_n:

        m_n   = max_v z_nv                      all-reduce MAX of the local maxima      [N]
        S_n   = sum_v exp(z_nv - m_n)           all-reduce SUM of the local sums        [N]
        z_ny  = the target logit - m_n          all-reduce SUM (0 on ranks without y_n) [N]
        loss  = mean over tokens with y_n != ignore_index of (log S_n - z_ny)

    S and z_ny travel in one [2, N] all-reduce. Backward is exact and local:
    d loss / d z_nv = (softmax_nv - [v == y_n]) / n_valid for valid tokens, 0 for ignored ones.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, comm: Comm, ignore_index: int, mean: bool = True) -> Tensor:
        # logits [N, V/t] fp32, labels [N] int64
        v_local = logits.shape[-1]
        start = comm.rank * v_local
        row_max = logits.max(dim=-1).values                                 # [N]
        comm.all_reduce(row_max, op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)                            # [N, V/t], <= 0
        valid = labels != ignore_index                                      # [N]
        local = labels - start
        mine = valid & (local >= 0) & (local < v_local)                     # target logit lives on this rank
        index = local.masked_fill(~mine, 0)                                 # [N] in [0, V/t)
        target = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = shifted.exp_()                                                # reuse the buffer: [N, V/t]
        sums = torch.stack([exp.sum(dim=-1), target])                       # [2, N]
        comm.all_reduce(sums)
        sum_exp, target = sums[0], sums[1]
        per_token = (sum_exp.log() - target).masked_fill(~valid, 0.0)       # [N]
        # 0 -> nan, as torch's mean; the sum (context parallelism divides by every cp rank's count) divides by 1
        count = valid.sum().to(logits.dtype) if mean else torch.ones((), dtype=logits.dtype, device=logits.device)
        softmax = exp.div_(sum_exp.unsqueeze(-1))                           # [N, V/t]
        ctx.save_for_backward(softmax, index, mine, valid, count)
        return per_token.sum() / count

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, None, None, None, None]:
        softmax, index, mine, valid, count = ctx.saved_tensors
        scale = grad_loss / count
        grad = softmax * (valid.to(softmax.dtype) * scale).unsqueeze(-1)    # [N, V/t]; 0 on ignored rows
        # subtract the one-hot of the target, on the rank holding it
        grad.scatter_add_(-1, index.unsqueeze(-1), -(mine.to(softmax.dtype) * scale).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: Tensor, labels: Tensor, comm: Comm,
                                 ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy of vocabulary-sharded logits `local_logits` [b, s, V/t] (any float dtype; computed
    in fp32) against `labels` [b, s] holding global token ids; tokens labelled `ignore_index` are left out.
    Equals `F.cross_entropy(full_logits.float().reshape(-1, V), labels.reshape(-1))` on every rank."""
    if local_logits.shape[:-1] != labels.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(local_logits.shape)} and labels "
                         f"{tuple(labels.shape)} must agree on every dimension but the last (vocabulary)")
    logits = local_logits.float().reshape(-1, local_logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(logits, labels.reshape(-1), comm, ignore_index)


class VocabParallelLoss:
    """`loss(logits, labels)` bound to a TP group, for a model whose lm-head keeps its logits sharded by
    vocabulary: a plan installs it as `model.loss` (the built-in GPT's does), so `model(ids, labels)` returns the
    loss of vocabulary-sharded logits."""

    def __init__(self, comm: Comm, ignore_index: int = IGNORE_INDEX):
        self.comm = comm
        self.ignore_index = ignore_index

    def __call__(self, logits: Tensor, labels: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.comm, self.ignore_index)

    def token_loss_sum(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The sum (not the mean) of the valid tokens' losses: what context parallelism adds up over its ranks."""
        if logits.shape[:-1] != labels.shape:
            raise ValueError(f"token_loss_sum: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must "
                             f"agree on every dimension but the last (vocabulary)")
        flat = logits.float().reshape(-1, logits.shape[-1])
        out: Tensor = _VocabParallelCrossEntropy.apply(flat, labels.reshape(-1), self.comm, self.ignore_index, False)
        return out

    def __repr__(self) -> str:
        return f"VocabParallelLoss(tp={self.comm.size}, ignore_index={self.ignore_index})"
