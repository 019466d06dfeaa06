"""The Llama pieces of our decoder: RMSNorm and the SwiGLU MLP. `GPT` picks them by `GPTConfig.norm` and
`GPTConfig.mlp`, so a Llama-style model is our GPT with other parts: same module names, same pipeline split,
same tensor-parallel plan (plus `mlp.fc_gate`, column-parallel like `mlp.fc_in`).

Both compute as transformers' LlamaRMSNorm / LlamaMLP do (the norm in fp32, cast back before the weight), so
weights copied from a LlamaForCausalLM give its logits (tests/unit/test_llama.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.models.presets import GPTConfig


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, [.., d] -> [.., d]. The statistics in fp32 (a bf16
    mean of squares loses the small features); the weight multiplies the result cast back to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SwiGLU(nn.Module):
    """fc_out(silu(fc_gate(x)) * fc_in(x)): [b, s, d] -> [b, s, d_ff] (twice) -> [b, s, d]. Gate and up
    projections are separate Linears so tensor parallelism splits each by columns (a fused [d, 2 d_ff] weight
    would need its halves interleaved per rank)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.d_ff is not None
        self.fc_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc_out(F.silu(self.fc_gate(x)) * self.fc_in(x)))


def make_norm(cfg: GPTConfig) -> nn.Module:
    """The config's normalisation over d_model."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
