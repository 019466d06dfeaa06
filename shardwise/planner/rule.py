"""The usual rule of thumb for choosing a parallel strategy, and how the search's answer relates to it.

The rule, for a model of psi parameters on N GPUs of memory M each, takes the first strategy that fits:
    1. data parallelism, if a full replica (weights, gradients, optimizer state, activations) fits in M;
    2. else ZeRO-2/3, which shard the model states over the N GPUs (Rajbhandari et al. 2020, "ZeRO: Memory
       Optimizations Toward Training Trillion Parameter Models");
    3. else ZeRO-3 with the optimizer state and parameters offloaded to CPU memory;
    4. else 3D parallelism (DP + TP + PP).

It is the search's answer in the special case where memory is the only thing that tells the strategies
apart: DP and ZeRO-1/2 move the same 2 psi per step, ZeRO-3 moves 3 psi, offload adds PCIe traffic and a
CPU optimizer step, 3D adds per-layer TP all-reduces and a pipeline bubble; so each step down the list
costs time and is only worth taking when the previous one does not fit. The search drops the assumption:
it prices every strategy on the actual links and batch, and can prefer, say, TP over NVLink to ZeRO-3
over a slow network, or find the rule's choice unusable (a global batch that dp does not divide).

"Fits" here is the rule's own test, the most favourable case for each strategy: micro-batch 1 with full
recomputation, tp = pp = 1, dp = N.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shardwise.planner.memory import GB, memory_per_rank
from shardwise.planner.search import Evaluation, SearchResult
from shardwise.planner.specs import ClusterSpec, JobSpec, ModelSpec, Offload, Plan, Recompute


class Strategy(str, enum.Enum):
    DP = "data parallelism"
    ZERO = "ZeRO (sharded data parallelism)"
    ZERO_OFFLOAD = "ZeRO + CPU offload"
    THREE_D = "3D parallelism (DP + TP + PP)"


RULE_ORDER = (Strategy.DP, Strategy.ZERO, Strategy.ZERO_OFFLOAD, Strategy.THREE_D)


def strategy_of(plan: Plan) -> Strategy:
    if plan.tp > 1 or plan.pp > 1:
        return Strategy.THREE_D
    if plan.offload is not Offload.NONE:
        return Strategy.ZERO_OFFLOAD
    return Strategy.ZERO if plan.zero_stage >= 1 else Strategy.DP


@dataclass(frozen=True)
class RuleStep:
    strategy: Strategy
    plan: Plan           # the most favourable plan of the strategy (see the module notes)
    gpu_bytes: float
    capacity: float
    fits: bool


@dataclass(frozen=True)
class RuleVerdict:
    strategy: Strategy
    steps: tuple[RuleStep, ...]   # the tests made, in the rule's order, up to the one that held

    def lines(self) -> list[str]:
        out = []
        for s in self.steps:
            verb = "fits" if s.fits else "does not fit"
            out.append(f"{s.strategy.value}: {s.gpu_bytes / GB:.1f} GB per GPU ({s.plan.label()}) {verb} in "
                       f"{s.capacity / GB:.1f} GB")
        if self.strategy is Strategy.THREE_D:
            out.append("nothing else fits: 3D parallelism")
        return out


def rule_of_thumb(model: ModelSpec, cluster: ClusterSpec, job: JobSpec) -> RuleVerdict:
    """Apply the rule literally (memory only) and say which strategy it picks."""
    base = Plan(dp=cluster.num_gpus, micro_batch=1, recompute=Recompute.FULL)
    candidates = (
        (Strategy.DP, base),
        (Strategy.ZERO, base.replace(zero_stage=3)),
        (Strategy.ZERO_OFFLOAD, base.replace(zero_stage=3, offload=Offload.OPTIMIZER_AND_PARAMS)),
    )
    steps = []
    for strategy, plan in candidates:
        mem = memory_per_rank(model, cluster, job, plan)
        steps.append(RuleStep(strategy, plan, mem.total, mem.capacity, mem.fits))
        if mem.fits:
            return RuleVerdict(strategy, tuple(steps))
    return RuleVerdict(Strategy.THREE_D, tuple(steps))


_PARTS = (("compute_s", "compute"), ("tp_comm_s", "tensor-parallel communication"),
          ("pp_comm_s", "pipeline sends"), ("bubble_s", "pipeline bubble"),
          ("dp_exposed_s", "exposed data-parallel communication"), ("optimizer_s", "optimizer step"),
          ("offload_s", "offload traffic"))


def compare_with_search(verdict: RuleVerdict, result: SearchResult, chosen: Evaluation | None) -> list[str]:
    """Sentences relating the rule's pick to the search's: agreement, or where the time goes."""
    if chosen is None or chosen.time is None:
        return [f"The rule picks {verdict.strategy.value}; the search found no feasible plan at all."]
    found = strategy_of(chosen.plan)
    if found is verdict.strategy:
        return [f"The search agrees with the rule: {found.value} ({chosen.plan.label()}, "
                f"{chosen.time.total_s:.4g} s per step)."]
    lines = [f"The rule picks {verdict.strategy.value}; the search picks {found.value} "
             f"({chosen.plan.label()}, {chosen.time.total_s:.4g} s per step)."]
    rivals = [e for e in result.ranked if strategy_of(e.plan) is verdict.strategy and e.time is not None]
    if not rivals:
        lines.append(f"No {verdict.strategy.value} plan is feasible on this job: the rule checks memory only, "
                     f"not the batch arithmetic or the micro-batch the memory allows.")
        return lines
    rival = rivals[0]
    assert rival.time is not None
    slower = rival.time.total_s / chosen.time.total_s - 1
    if slower <= 0:
        lines.append(f"The best {verdict.strategy.value} plan ({rival.plan.label()}) is as fast within the "
                     f"model's resolution; the search prefers the simpler plan.")
        return lines
    deltas = sorted(((getattr(rival.time, k) - getattr(chosen.time, k), name) for k, name in _PARTS), reverse=True)
    worst, name = deltas[0]
    if name == "compute" and rival.plan.recompute is not chosen.plan.recompute:
        name = f"compute ({rival.plan.recompute.value} recomputation against {chosen.plan.recompute.value})"
    lines.append(f"The best {verdict.strategy.value} plan ({rival.plan.label()}) takes {rival.time.total_s:.4g} s "
                 f"per step, {100 * slower:.0f}% longer, mostly from {name} (+{worst:.3g} s).")
    return lines
