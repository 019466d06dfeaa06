"""Everything `shardwise plan` reports, computed once: counts and cost, memory per strategy, the search
(or one given plan), its communication and pipeline figures, and the rule of thumb (see `rule`)."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.models.presets import GPTConfig
from shardwise.planner.comm import Collective, step_collectives
from shardwise.planner.flops import ParamCount, TrainingCost, days, narayanan_train_seconds, param_count, training_cost
from shardwise.planner.memory import MemoryBreakdown, layer_activation_bytes, memory_per_rank
from shardwise.planner.rule import RuleVerdict, compare_with_search, recommendation_reason, rule_of_thumb
from shardwise.planner.search import TIE_TOLERANCE, Evaluation, SearchResult, evaluate, recommend, search
from shardwise.planner.specs import ClusterSpec, JobSpec, Offload, Plan, Recompute
from shardwise.planner.time import hfu, mfu, steps_to_train

STRATEGY_ROWS: tuple[tuple[str, int, Offload], ...] = (
    ("DP (ZeRO-0)", 0, Offload.NONE),
    ("ZeRO-1", 1, Offload.NONE),
    ("ZeRO-2", 2, Offload.NONE),
    ("ZeRO-3", 3, Offload.NONE),
    ("ZeRO-2 + offload optimizer", 2, Offload.OPTIMIZER),
    ("ZeRO-3 + offload optimizer+params", 3, Offload.OPTIMIZER_AND_PARAMS),
)


@dataclass(frozen=True)
class StrategyMemory:
    name: str
    plan: Plan
    memory: MemoryBreakdown


@dataclass(frozen=True)
class TrainTime:
    steps: float
    seconds: float            # steps * the chosen plan's step time
    gpu_days: float
    mfu: float
    hfu: float                # with recomputation: the papers' "% of peak"
    narayanan_days: float     # eq. 4 at the cluster's achieved FLOP/s (peak * efficiency)
    gpu_days_at_peak: float   # 6ND / peak: the floor, every GPU at its peak (312 TFLOPS bf16 on an A100)


@dataclass(frozen=True)
class Analysis:
    model: GPTConfig
    cluster: ClusterSpec
    job: JobSpec
    params: ParamCount
    cost: TrainingCost
    strategies: tuple[StrategyMemory, ...]
    activations_per_layer: dict[str, float]   # recompute policy -> bytes, for the chosen micro-batch, tp and cp
    result: SearchResult | None                # None when one plan was given
    chosen: Evaluation | None                  # the recommended (or given) plan
    collectives: tuple[Collective, ...]
    bubble: float | None                       # share of the step, pipelines only
    train: TrainTime | None
    rule: RuleVerdict
    rule_comparison: tuple[str, ...]
    reason: str | None = None                  # why the search recommends its plan


def _train_time(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, chosen: Evaluation,
                cost: TrainingCost) -> TrainTime | None:
    if chosen.time is None:
        return None
    steps = steps_to_train(job, model, cost.params)
    seconds = steps * chosen.time.total_s
    peak = cluster.peak_flops(job.precision)
    eq4 = narayanan_train_seconds(tokens=cost.tokens, num_params=cost.params, num_gpus=cluster.num_gpus,
                                  achieved_flops=peak * cluster.compute_efficiency)
    return TrainTime(steps=steps, seconds=seconds, gpu_days=days(seconds) * cluster.num_gpus,
                     mfu=mfu(chosen.time, cluster, job, cluster.num_gpus),
                     hfu=hfu(chosen.time, cluster, job, cluster.num_gpus), narayanan_days=days(eq4),
                     gpu_days_at_peak=cost.gpu_days(cost.flops_6nd, peak))


def analyze(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan | None = None) -> Analysis:
    """Search the plans on `cluster` (or evaluate `plan`) and gather the report's figures."""
    count = param_count(model)
    seq = job.sequence_length(model)
    cost = training_cost(model, tokens=job.total_tokens(count.total), seq_len=seq, causal=job.causal_flops)
    result = None
    if plan is None:
        result = search(model, cluster, job)
        chosen = recommend(result)
    else:
        chosen = evaluate(model, cluster, job, plan)
    ref = chosen.plan if chosen is not None else Plan(dp=cluster.num_gpus)
    strategies = tuple(
        StrategyMemory(name, p, memory_per_rank(model, cluster, job, p))
        for name, stage, offload in STRATEGY_ROWS
        for p in [Plan(dp=cluster.num_gpus, micro_batch=ref.micro_batch, zero_stage=stage, offload=offload)])
    per_layer = {r.value: layer_activation_bytes(model, micro_batch=ref.micro_batch, seq_len=seq, tp=ref.tp,
                                                 sequence_parallel=ref.sequence_parallel, recompute=r,
                                                 act_bytes=job.precision.nbytes,
                                                 flash_attention=job.flash_attention, cp=ref.cp,
                                                 cp_impl=ref.cp_impl) for r in Recompute}
    feasible = chosen is not None and chosen.feasible
    collectives: tuple[Collective, ...] = ()
    bubble = None
    train = None
    if chosen is not None and feasible:
        collectives = tuple(step_collectives(model, cluster, job, chosen.plan))
        if chosen.plan.pp > 1 and chosen.time is not None:   # the step's, with unequal stages (time.py)
            bubble = chosen.time.bubble_s / chosen.time.total_s
        train = _train_time(model, cluster, job, chosen, cost)
    verdict = rule_of_thumb(model, cluster, job)
    comparison = compare_with_search(verdict, result, chosen) if result is not None else []
    reason = (recommendation_reason(result, chosen, TIE_TOLERANCE)
              if result is not None and chosen is not None and chosen.time is not None else None)
    return Analysis(model=model, cluster=cluster, job=job, params=count, cost=cost, strategies=strategies,
                    activations_per_layer=per_layer, result=result, chosen=chosen, collectives=collectives,
                    bubble=bubble, train=train, rule=verdict, rule_comparison=tuple(comparison),
                    reason=reason)
