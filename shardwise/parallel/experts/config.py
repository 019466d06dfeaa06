"""What an MoE layer is: the router's rule, the capacity rule and the auxiliary losses, as one frozen section.

Validated once, where the layer is built: a bad value is one `UserError` line naming the value and the fix.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shardwise.errors import UserError


class ScoreFunction(enum.Enum):
    """How router logits [S, E] become scores: softmax over the experts (Switch, GShard, Mixtral) or an independent
    sigmoid per expert (DeepSeek-V3)."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class NoisyGate(enum.Enum):
    """DeepSpeed's `noisy_gate_policy`. JITTER: the router's input is multiplied by U(1 - 0.01, 1 + 0.01) noise
    while training. RSAMPLE: Gumbel noise is added to the logits that pick the top-1 expert (not to its weight)."""

    NONE = "None"
    JITTER = "Jitter"
    RSAMPLE = "RSample"


class DropPolicy(enum.Enum):
    """Which tokens an expert over capacity keeps. POSITION: first choices before second choices, each in token
    order (GShard; DeepSpeed's top-2). RANDOM: a random subset of its tokens (DeepSpeed's top-1 `use_rts`, random
    token selection). PROBABILITY: the tokens with the highest router scores (DeepSpeed's top-k for k > 2)."""

    POSITION = "position"
    RANDOM = "random"
    PROBABILITY = "probability"


class BalanceCount(enum.Enum):
    """What the load-balancing loss counts as an expert's share of tokens. FIRST_CHOICE: tokens whose top-1 it is
    (Switch; DeepSpeed's top-1 and top-2); ALL_CHOICES: all k choices, divided by k (DeepSpeed's top-k, k > 2)."""

    FIRST_CHOICE = "first"
    ALL_CHOICES = "all"


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer's routing. Capacity per expert and rank, when tokens are dropped:
    max(ceil(S / E * capacity_factor * k), min_capacity), S the tokens this rank routes."""

    num_experts: int
    top_k: int = 2
    score: ScoreFunction = ScoreFunction.SOFTMAX
    normalize_weights: bool = True
    """Divide each token's kept top-k weights by their sum (after dropping); False keeps the raw scores."""
    noisy_gate: NoisyGate = NoisyGate.NONE
    second_choice_noise: bool = False
    """Top-2 only: Gumbel noise on the logits that pick the second expert, in training and evaluation
    (DeepSpeed's `top2_2nd_expert_sampling`, on by default there)."""
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    """False: every token reaches its experts (no capacity)."""
    drop_policy: DropPolicy = DropPolicy.POSITION
    balance_count: BalanceCount = BalanceCount.FIRST_CHOICE
    aux_loss_coef: float = 0.0
    """Coefficient of the load-balancing loss added to the training loss by models that add it."""
    z_loss_coef: float = 0.0
    """Coefficient of the router z-loss, mean over tokens of logsumexp(logits)^2 (ST-MoE)."""

    def __post_init__(self) -> None:
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise UserError(f"num_experts = {self.num_experts!r}: an MoE layer needs at least one expert; "
                            f"pass a positive integer")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise UserError(f"k = {self.top_k!r} with {self.num_experts} experts: each token picks k distinct "
                            f"experts; use 1 <= k <= num_experts")
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if not value > 0:
                raise UserError(f"{name} = {value!r}: the capacity factor scales each expert's token budget and "
                                f"must be > 0; use 1.0 (an even share), more to drop fewer tokens, or "
                                f"drop_tokens=False")
        if isinstance(self.min_capacity, bool) or not isinstance(self.min_capacity, int) or self.min_capacity < 0:
            raise UserError(f"min_capacity = {self.min_capacity!r}: pass a non-negative integer")
        for name in ("aux_loss_coef", "z_loss_coef"):
            if not getattr(self, name) >= 0:
                raise UserError(f"{name} = {getattr(self, name)!r}: a loss coefficient must be >= 0")

    def capacity(self, num_tokens: int, *, training: bool) -> int:
        """Tokens one expert takes from this rank's `num_tokens` when dropping."""
        factor = self.capacity_factor if training else self.eval_capacity_factor
        per_expert = -(-num_tokens * factor * self.top_k // self.num_experts)      # ceil without float rounding
        return max(int(per_expert), self.min_capacity)


def check_expert_split(num_experts: int, ep_size: int) -> int:
    """Experts per rank; one line naming both values when ep does not divide them."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise UserError(f"ep_size = {ep_size!r}: pass a positive integer (1: every rank holds every expert)")
    if num_experts % ep_size:
        raise UserError(f"num_experts = {num_experts} is not divisible by ep_size = {ep_size}: each expert-parallel "
                        f"rank holds num_experts / ep_size experts; choose an ep_size dividing {num_experts}")
    return num_experts // ep_size
