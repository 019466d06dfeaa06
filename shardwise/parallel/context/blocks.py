"""The attention of one ring block: queries q [B, H, m, D] against one key/value block k, v [B, Hkv, n, D] (Hkv
divides H), returning the block's output and each query row's log-sum-exp; and the gradients of that block.

The backward of a block is given the final (merged) output and log-sum-exp of the whole attention. The gradient of
the whole attention with respect to one block's scores is p * (dout v^T - delta), where p = exp(scores - lse) is the
block's share of the full softmax and delta = rowsum(dout * out). A fused kernel's backward computes exactly this
from the (out, lse) it is handed: given the merged ones, it recomputes the block's probabilities against the global
normalizer, and the blocks' dq, dk, dv sum to the whole attention's.

Kernels (`block_kernel` picks one from the device, dtype and head size):
    cpu     torch's fused CPU flash attention (`aten._scaled_dot_product_flash_attention_for_cpu`) and its
            backward, fed fp32 (as the plain path computes; the ring merges in fp32)
    cuda    flash attention (fp16/bf16, head size a multiple of 8 up to 256, compute capability 8.0+), else
            memory-efficient attention (fp16/bf16/fp32, head size a multiple of 8), fed the input dtype
    other   `PlainBlocks`: fp32 matmuls, any device, dtype and head size; the scores of one block at a time
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

aten = torch.ops.aten
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class BlockKernel(Protocol):
    """One block's attention, forward and backward; q, k, v, dout and out come in `dtype`."""

    dtype: torch.dtype

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
        """-> out [B, H, m, D] (in `dtype`), lse [B, H, m] (fp32); causal: the square block's lower triangle."""
        ...

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                 causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        """`out`, `lse`: the final ones of these query rows -> dq [B, H, m, D], dk, dv [B, Hkv, n, D]."""
        ...


def expand_heads(x: Tensor, groups: int) -> Tensor:
    """Key/value heads [B, Hkv, n, D] -> [B, Hkv * groups, n, D]: each serves `groups` consecutive query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def fold_heads(grad: Tensor, groups: int) -> Tensor:
    """The gradient of `expand_heads`: [B, Hkv * groups, n, D] -> [B, Hkv, n, D], summed over each kv head's
    query heads."""
    if groups == 1:
        return grad
    b, h, n, d = grad.shape
    return grad.view(b, h // groups, groups, n, d).sum(dim=2)


def _causal_mask(rows: int, cols: int, device: torch.device) -> Tensor:
    """True where a query may not see a key: above the diagonal of a square (local) block."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).triu(1)


class PlainBlocks:
    """fp32 matmuls on any device; memory O(m n) for the scores of one block."""

    dtype = torch.float32

    @staticmethod
    def _scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale                      # [B, H, m, n]
        if causal:
            scores = scores.masked_fill(_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
        return scores

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
        groups = q.shape[1] // k.shape[1]
        scores = self._scores(q, expand_heads(k, groups), scale, causal)
        lse = torch.logsumexp(scores, dim=-1)
        return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), expand_heads(v, groups)), lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                 causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        groups = q.shape[1] // k.shape[1]
        k, v = expand_heads(k, groups), expand_heads(v, groups)
        p = torch.exp(self._scores(q, k, scale, causal) - lse.unsqueeze(-1))
        delta = (dout * out).sum(dim=-1, keepdim=True)                                  # [B, H, m, 1]
        dv = torch.matmul(p.transpose(-1, -2), dout)
        ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, k) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q) * scale
        return dq, fold_heads(dk, groups), fold_heads(dv, groups)


class CpuFlashBlocks:
    """torch's fused CPU flash attention: the scores never materialise; grouped-query heads taken as they are."""

    dtype = torch.float32

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                 causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        return dq, dk, dv


class CudaFlashBlocks:
    """CUDA flash attention (fp16/bf16). Key/value heads are repeated to the query heads and the gradients folded."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
        groups = q.shape[1] // k.shape[1]
        result = aten._scaled_dot_product_flash_attention(q, expand_heads(k, groups), expand_heads(v, groups),
                                                          0.0, causal, False, scale=scale)
        return result[0], result[1]                                                   # out, lse [B, H, m] fp32

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                 causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        groups = q.shape[1] // k.shape[1]
        unused = torch.empty((), dtype=torch.int64, device=q.device)                 # dropout's seed: no dropout
        # No cumulative sequence lengths: dense (not packed) batches.
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, expand_heads(k, groups), expand_heads(v, groups), out, lse.contiguous(), None, None,
            q.shape[-2], k.shape[-2], 0.0, causal, unused, unused, scale=scale)
        return dq, fold_heads(dk, groups), fold_heads(dv, groups)


LSE_ALIGN = 32
"""The memory-efficient kernel's log-sum-exp rows come padded to a multiple of this: [B, H, ceil(m / 32) * 32]."""


class CudaEfficientBlocks:
    """CUDA memory-efficient attention (fp32/fp16/bf16). Key/value heads repeated, gradients folded."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
        groups = q.shape[1] // k.shape[1]
        result = aten._scaled_dot_product_efficient_attention(q, expand_heads(k, groups), expand_heads(v, groups),
                                                              None, True, 0.0, causal, scale=scale)
        return result[0], result[1][..., :q.shape[-2]]

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                 causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        groups = q.shape[1] // k.shape[1]
        m = q.shape[-2]
        padded = F.pad(lse, (0, -m % LSE_ALIGN))                                      # as the forward returned it
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, expand_heads(k, groups), expand_heads(v, groups), None, out, padded, unused, unused, 0.0,
            [True, True, True, False], causal, scale=scale)
        return dq, fold_heads(dk, groups), fold_heads(dv, groups)


def block_kernel(q: Tensor) -> BlockKernel:
    """The fastest kernel that applies to queries like `q` [B, H, m, D]; the plain matmuls where none does."""
    head = q.shape[-1]
    if q.dtype not in FUSED_DTYPES:
        return PlainBlocks()
    if q.device.type == "cpu":
        return CpuFlashBlocks()
    if q.device.type == "cuda" and head % 8 == 0:
        if q.dtype != torch.float32 and head <= 256 and torch.cuda.get_device_capability(q.device)[0] >= 8:
            return CudaFlashBlocks(q.dtype)
        return CudaEfficientBlocks(q.dtype)
    return PlainBlocks()
