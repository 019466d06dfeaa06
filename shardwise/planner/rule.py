"""The usual rule of thumb for choosing a parallel strategy (DP, else ZeRO, else ZeRO-Offload, else 3D: the first
that fits in memory), and how the search's answer relates to it (`rule_of_thumb`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shardwise.models.presets import GPTConfig
from shardwise.planner.memory import GB, memory_per_rank
from shardwise.planner.search import Evaluation, SearchResult
from shardwise.planner.specs import ClusterSpec, JobSpec, Offload, Plan, Recompute


class Strategy(str, enum.Enum):
    DP = "data parallelism"
    ZERO = "ZeRO (sharded data parallelism)"
    ZERO_OFFLOAD = "ZeRO + CPU offload"
    MODEL_PARALLEL = "model parallelism (TP, PP and/or CP, not all three of DP, TP, PP)"
    THREE_D = "3D parallelism (DP + TP + PP)"


RULE_ORDER = (Strategy.DP, Strategy.ZERO, Strategy.ZERO_OFFLOAD, Strategy.THREE_D)


def strategy_of(plan: Plan) -> Strategy:
    """"3D" only with all three axes (pp > 1, tp > 1, dp > 1); TP or PP with fewer axes is model parallelism
    (a TP x ZeRO-3 plan with no pipeline is not 3D). Context parallelism splits the activations, not the
    model, but like TP it communicates every layer: it counts as model parallelism."""
    if plan.tp > 1 and plan.pp > 1 and plan.dp > 1:
        return Strategy.THREE_D
    if plan.tp > 1 or plan.pp > 1 or plan.cp > 1:
        return Strategy.MODEL_PARALLEL
    if plan.offload is not Offload.NONE:
        return Strategy.ZERO_OFFLOAD
    return Strategy.ZERO if plan.zero_stage >= 1 else Strategy.DP


def describe(plan: Plan) -> str:
    """The plan in an engineer's words: its axes, the ZeRO stage and offload, e.g.
    "3D: TP 8 (+SP) x PP 16 x DP 8, ZeRO-1" or "TP 8 x ZeRO-3 over DP 4"."""
    axes = [f"TP {plan.tp}" + (" (+SP)" if plan.sequence_parallel else "")] if plan.tp > 1 else []
    if plan.pp > 1:
        axes.append(f"PP {plan.pp}" + (f" (interleaved x{plan.virtual_stages})" if plan.virtual_stages > 1 else ""))
    if plan.cp > 1:
        axes.append(f"CP {plan.cp} ({plan.cp_impl.value})")
    zero = f"ZeRO-{plan.zero_stage}" + (f" + offload {plan.offload.value}" if plan.offload is not Offload.NONE else "")
    if plan.dp > 1:
        if plan.zero_stage and plan.pp == 1:
            axes.append(f"{zero} over DP {plan.dp}")
            zero = ""
        else:
            axes.append(f"DP {plan.dp}")
    elif plan.offload is not Offload.NONE:
        axes.append(zero)
        zero = ""
    text = " x ".join(axes) or "one GPU"
    if zero and plan.zero_stage:
        text += f", {zero}"
    if plan.ep > 1:
        text += f", experts over EP {plan.ep}"
    return ("3D: " if strategy_of(plan) is Strategy.THREE_D else "") + text


def _rule_step(strategy: Strategy) -> Strategy:
    """The rule's last step is any model parallelism."""
    return Strategy.THREE_D if strategy is Strategy.MODEL_PARALLEL else strategy


@dataclass(frozen=True)
class RuleStep:
    strategy: Strategy
    plan: Plan           # the most favourable plan of the strategy (see `rule_of_thumb`)
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
            out.append("nothing else fits: model parallelism (TP/PP, CP for long sequences; 3D with DP as well)")
        return out


def rule_of_thumb(model: GPTConfig, cluster: ClusterSpec, job: JobSpec) -> RuleVerdict:
    """Apply the rule literally (memory only) and say which strategy it picks.

    The rule, for a model of psi parameters on N GPUs of memory M each, takes the first strategy that fits:
        1. data parallelism, if a full replica (weights, gradients, optimizer state, activations) fits in M;
        2. else ZeRO-2/3, which shard the model states over the N GPUs (Rajbhandari et al. 2020, "ZeRO: Memory
           Optimizations Toward Training Trillion Parameter Models");
        3. else ZeRO-3 with the optimizer state and parameters offloaded to CPU memory;
        4. else 3D parallelism (DP + TP + PP).
    "Fits" is the rule's own test, the most favourable case for each strategy: micro-batch 1 with full
    recomputation, tp = pp = 1, dp = N.

    It is the search's answer in the special case where memory is the only thing that tells the strategies
    apart: DP and ZeRO-1/2 move the same 2 psi per step, ZeRO-3 moves 3 psi, offload adds PCIe traffic and a
    CPU optimizer step, 3D adds per-layer TP all-reduces and a pipeline bubble; so each step down the list
    costs time and is only worth taking when the previous one does not fit. The search drops the assumption:
    it prices every strategy on the actual links and batch, and can prefer, say, TP over NVLink to ZeRO-3
    over a slow network, or find the rule's choice unusable (a global batch that dp does not divide).
    """
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
          ("cp_comm_s", "exposed context-parallel communication"),
          ("ep_comm_s", "expert-parallel all-to-alls"),
          ("pp_comm_s", "pipeline sends"), ("bubble_s", "pipeline bubble"),
          ("dp_exposed_s", "exposed data-parallel communication"), ("optimizer_s", "optimizer step"),
          ("offload_s", "offload traffic"))


def compare_with_search(verdict: RuleVerdict, result: SearchResult, chosen: Evaluation | None) -> list[str]:
    """Sentences relating the rule's pick to the search's: agreement, or where the time goes."""
    if chosen is None or chosen.time is None:
        return [f"The rule picks {verdict.strategy.value}; the search found no feasible plan at all."]
    found = strategy_of(chosen.plan)
    if _rule_step(found) is verdict.strategy:
        return [f"The search agrees with the rule: {found.value} ({chosen.plan.label()}, "
                f"{chosen.time.total_s:.4g} s per step)."]
    lines = [f"The rule picks {verdict.strategy.value}; the search picks {found.value} "
             f"({chosen.plan.label()}, {chosen.time.total_s:.4g} s per step)."]
    rivals = [e for e in result.ranked if _rule_step(strategy_of(e.plan)) is verdict.strategy and e.time is not None]
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


def recommendation_reason(result: SearchResult, chosen: Evaluation, tolerance: float) -> str:
    """Why the search recommends `chosen`: its strategy, its rank, and where its step time goes."""
    assert chosen.time is not None
    best = result.best
    assert best is not None and best.time is not None
    t = chosen.time
    parts = sorted(((getattr(t, k), name) for k, name in _PARTS), reverse=True)
    spent = ", ".join(f"{name} {100 * v / t.total_s:.0f}%" for v, name in parts[:3] if v > 0)
    if chosen is best:
        head = f"the fastest of {len(result.ranked)} feasible plans"
    else:
        a, b = chosen.plan, best.plan
        simpler = [what for what, yes in (
            ((f"{a.tp * a.pp * a.cp} model-parallel ranks" if a.tp * a.pp * a.cp > 1 else "no model parallelism")
             + f", not {b.tp * b.pp * b.cp}", a.tp * a.pp * a.cp < b.tp * b.pp * b.cp),
            ("no offload", a.offload is Offload.NONE and b.offload is not Offload.NONE),
            (f"{a.recompute.value} recomputation, not {b.recompute.value}", a.recompute is not b.recompute),
            (f"ZeRO-{a.zero_stage}, not ZeRO-{b.zero_stage}", a.zero_stage < b.zero_stage),
            (f"micro-batch {a.micro_batch}, not {b.micro_batch}", a.micro_batch > b.micro_batch)) if yes]
        head = (f"the simplest plan within {100 * tolerance:.0f}% of the fastest ({b.label()}, "
                f"{best.time.total_s:.4g} s; this one {100 * (t.total_s / best.time.total_s - 1):.1f}% slower with "
                f"{', '.join(simpler) or 'the same shape'})")
    return f"{describe(chosen.plan)} ({strategy_of(chosen.plan).value}): {head}; its step is {spent}."
