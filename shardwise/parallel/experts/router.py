"""The router: scores of E experts per token, the top-k choices, capacity and the auxiliary losses.

    x [S, H] -> logits [S, E] (fp32) -> scores [S, E] -> top-k (expert [S, k], weight [S, k], kept [S, k])

Everything here is local to the rank (its own S tokens): the capacity is per expert and rank, as DeepSpeed's,
and no collective runs. Random draws (noise, random token selection) come from torch's default generator in a
fixed order, so two runs from one seed route alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.parallel.experts.config import BalanceCount, DropPolicy, MoEConfig, NoisyGate, ScoreFunction

JITTER_EPS = 1e-2
"""Half-width of the multiplicative jitter on the router's input (Switch Transformer's value, DeepSpeed's)."""


@dataclass(frozen=True)
class Routing:
    """Where each of S tokens goes. Choice j of token s: `expert[s, j]` with `weight[s, j]`, dropped unless
    `kept[s, j]` (a dropped choice contributes nothing: the residual connection around the layer carries it)."""

    expert: Tensor          # [S, k] int64
    weight: Tensor          # [S, k] fp32, 0 where dropped
    kept: Tensor            # [S, k] bool
    counts: Tensor          # [E] int64: choices per expert before capacity (DeepSpeed's exp_counts)
    aux_loss: Tensor        # 0-dim fp32: the load-balancing loss, without its coefficient
    z_loss: Tensor          # 0-dim fp32: the router z-loss, without its coefficient


class Router(nn.Module):
    """A bias-free Linear H -> E (`wg`, DeepSpeed's name) and the routing rule of `cfg`. The logits are computed
    in fp32 (input and weight cast), as DeepSpeed's gate does: in bf16 near-equal scores would swap experts."""

    def __init__(self, hidden_size: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wg = nn.Linear(hidden_size, cfg.num_experts, bias=False)

    def forward(self, x: Tensor) -> Routing:
        cfg = self.cfg
        xf = x.float()                                                        # [S, H]
        if cfg.noisy_gate is NoisyGate.JITTER and self.training:
            xf = xf * _uniform(xf.shape, 1.0 - JITTER_EPS, 1.0 + JITTER_EPS, x.device)
        logits = F.linear(xf, self.wg.weight.float())                         # [S, E]
        return route(logits, cfg, training=self.training)


def _uniform(shape: torch.Size, low: float, high: float, device: torch.device) -> Tensor:
    """U(low, high) [shape] fp32 as torch.distributions.Uniform draws it: low + rand * (high - low) in fp32. The
    bounds are fp32 numbers made on the host (its argument checks, and fp32 tensors copied to a GPU, would wait
    for the device); a Python float holding an fp32 value enters fp32 arithmetic unchanged."""
    lo, hi = np.float32(low), np.float32(high)
    return float(lo) + torch.rand(shape, device=device) * float(hi - lo)


def _gumbel(shape: torch.Size, device: torch.device) -> Tensor:
    """Gumbel(0, 1) [shape] fp32 as torch.distributions.Gumbel draws it: -log(-log(u)), u ~ U(tiny, 1 - eps)."""
    finfo = torch.finfo(torch.float32)
    return -torch.log(-torch.log(_uniform(shape, finfo.tiny, 1.0 - finfo.eps, device)))


def route(logits: Tensor, cfg: MoEConfig, *, training: bool) -> Routing:
    """The routing of fp32 `logits` [S, E] under `cfg` (pure apart from the random draws it documents)."""
    num_tokens, num_experts = logits.shape
    k = cfg.top_k
    scores = logits.softmax(dim=-1) if cfg.score is ScoreFunction.SOFTMAX else logits.sigmoid()   # [S, E]
    if cfg.noisy_gate is NoisyGate.RSAMPLE and training:
        # Gumbel noise picks the first choice; its weight stays the clean score.
        noisy = logits + _gumbel(logits.shape, logits.device)
        first = noisy.argmax(dim=-1, keepdim=True)                           # [S, 1]
        rest = scores.scatter(1, first, float("-inf")).topk(k - 1, dim=-1).indices if k > 1 else first[:, :0]
        expert = torch.cat([first, rest], dim=-1)                             # [S, k]
    elif cfg.second_choice_noise and k == 2:
        first = scores.argmax(dim=-1, keepdim=True)                           # [S, 1]
        noisy = (logits + _gumbel(logits.shape, logits.device)).scatter(1, first, float("-inf"))
        expert = torch.cat([first, noisy.argmax(dim=-1, keepdim=True)], dim=-1)
    else:
        expert = scores.topk(k, dim=-1).indices                               # [S, k], best first
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, expert, True)          # [S, E]
    counts = chosen.sum(dim=0)                                                # [E] before capacity

    # Load balance: E * sum_e (mean score of e) * (share of tokens routed to e).
    probs = scores if cfg.score is ScoreFunction.SOFTMAX else scores / scores.sum(dim=-1, keepdim=True)
    if cfg.balance_count is BalanceCount.FIRST_CHOICE:
        share = F.one_hot(expert[:, 0], num_experts).float().mean(dim=0)     # [E]
    else:
        share = chosen.float().mean(dim=0) / k
    aux_loss = (probs.mean(dim=0) * share).sum() * num_experts
    z_loss = torch.logsumexp(logits, dim=-1).square().mean()

    if cfg.drop_tokens:
        kept = _within_capacity(expert, scores, cfg, training=training)
    else:
        kept = torch.ones_like(expert, dtype=torch.bool)
        if cfg.drop_policy is DropPolicy.RANDOM:
            # DeepSpeed's top-1 draws its random selection even when nothing is dropped; drawing it too keeps
            # the default generator where DeepSpeed's is, so later draws (dropout, noise) agree.
            torch.rand((num_tokens, num_experts), device=logits.device)
    weight = scores.gather(1, expert) * kept                                  # [S, k]
    if cfg.normalize_weights and k > 1:
        weight = weight / weight.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weight.dtype).eps)
    return Routing(expert, weight, kept, counts, aux_loss, z_loss)


def _within_capacity(expert: Tensor, scores: Tensor, cfg: MoEConfig, *, training: bool) -> Tensor:
    """kept [S, k]: which choices fit in their expert's capacity under the drop policy."""
    num_tokens, k = expert.shape
    num_experts = scores.shape[1]
    capacity = min(cfg.capacity(num_tokens, training=training), num_tokens)
    one_hot = F.one_hot(expert, num_experts)                                  # [S, k, E]
    if cfg.drop_policy is DropPolicy.POSITION:
        # Slot of each choice in its expert's queue: all first choices in token order, then all second ones.
        by_choice = one_hot.transpose(0, 1).reshape(k * num_tokens, num_experts)             # [k*S, E]
        slot = (by_choice.cumsum(dim=0) - 1).reshape(k, num_tokens, num_experts).transpose(0, 1)   # [S, k, E]
        return ((slot * one_hot).sum(dim=-1) < capacity)                      # [S, k]
    # RANDOM / PROBABILITY: each expert keeps its `capacity` best-ranked tokens.
    routed = one_hot.sum(dim=1)                                               # [S, E] 0/1
    if cfg.drop_policy is DropPolicy.RANDOM:
        rank_by = routed * torch.rand(routed.shape, device=scores.device)
    else:
        rank_by = routed * scores
    keep = torch.zeros_like(routed).scatter_(0, rank_by.topk(capacity, dim=0).indices, 1) * routed   # [S, E]
    return keep.gather(1, expert).bool()                                      # [S, k]
