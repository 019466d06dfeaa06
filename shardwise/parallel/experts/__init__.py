"""Mixture of experts and expert parallelism: the routing rule (`config.py`, `router.py`), the token exchange
over an ep group (`dispatch.py`), the layer (`layer.py`) and the groups built from the data-parallel ranks
(`groups.py`). Expert parameters carry their expert-dp group (`parallel/replicas.py`), which the
data-parallel strategies reduce their gradients over."""

from shardwise.parallel.experts.config import BalanceCount, DropPolicy, MoEConfig, NoisyGate, ScoreFunction
from shardwise.parallel.experts.groups import ExpertGroups, build_expert_groups, expert_layout
from shardwise.parallel.experts.layer import MoELayer, apply_expert_parallel, moe_layers, moe_loss, shard_experts
from shardwise.parallel.experts.metrics import MOE_METRIC_KEYS, moe_step_metrics
from shardwise.parallel.experts.router import Router, Routing

__all__ = ["MOE_METRIC_KEYS", "BalanceCount", "DropPolicy", "ExpertGroups", "MoEConfig", "MoELayer", "NoisyGate",
           "Router", "Routing", "ScoreFunction", "apply_expert_parallel", "build_expert_groups", "expert_layout",
           "moe_layers", "moe_loss", "moe_step_metrics", "shard_experts"]
