"""The search: every layout of the cluster's GPUs, ranked by estimated step time, and why others fail (each
plan that cannot run gets an `Infeasible` naming the rule it breaks).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shardwise.config import PipelineSchedule
from shardwise.config.schema import ContextParallelImpl
from shardwise.models.presets import GPTConfig
from shardwise.planner.memory import GB, MemoryBreakdown, memory_per_rank
from shardwise.planner.specs import ClusterSpec, JobSpec, Offload, Plan, Recompute
from shardwise.planner.time import StepTime, step_time

MAX_MICRO_BATCH = 64
INTERLEAVED_CHUNKS = 2


class Reason(str, enum.Enum):
    WORLD_SIZE = "dp * cp * tp * pp != GPUs"
    TP_OVER_NODE = "tp > GPUs per node"
    TP_HEADS = "heads not divisible by tp"
    TP_FFN = "d_ff not divisible by tp"
    PP_LAYERS = "pp > layers"
    CP_SEQUENCE = "sequence not divisible by the cp chunks"
    CP_HEADS = "heads not divisible by cp (Ulysses)"
    EP_EXPERTS = "experts not divisible by ep"
    BATCH = "global batch not divisible"
    INTERLEAVING = "interleaving needs divisible layers and micro-batches"
    MEMORY = "GPU memory over budget"
    HOST_MEMORY = "host memory over budget"


@dataclass(frozen=True)
class Infeasible:
    plan: Plan
    reason: Reason
    detail: str


@dataclass(frozen=True)
class Evaluation:
    """A plan with its memory and step time (time is None when it cannot run)."""

    plan: Plan
    memory: MemoryBreakdown | None
    time: StepTime | None
    problems: tuple[Infeasible, ...] = ()

    @property
    def feasible(self) -> bool:
        return not self.problems


def layout_problems(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> list[Infeasible]:
    """Rules a plan breaks before memory is even considered."""
    out: list[Infeasible] = []

    def bad(reason: Reason, detail: str) -> None:
        out.append(Infeasible(plan, reason, detail))

    if plan.world_size != cluster.num_gpus:
        bad(Reason.WORLD_SIZE, f"dp * cp * tp * pp = {plan.dp} * {plan.cp} * {plan.tp} * {plan.pp} = "
                               f"{plan.world_size}, but the cluster has {cluster.num_gpus} GPUs")
    if plan.tp > cluster.gpus_per_node:
        bad(Reason.TP_OVER_NODE, f"tp = {plan.tp} > {cluster.gpus_per_node} GPUs per node: tensor parallelism "
                                 f"communicates every layer and must stay on NVLink")
    assert model.n_kv_head is not None and model.d_ff is not None
    if model.n_head % plan.tp or model.n_kv_head % plan.tp:
        bad(Reason.TP_HEADS, f"tp = {plan.tp} does not divide n_head = {model.n_head} and n_kv_head = "
                             f"{model.n_kv_head}: each TP rank takes whole heads")
    if model.d_ff % plan.tp:
        bad(Reason.TP_FFN, f"tp = {plan.tp} does not divide d_ff = {model.d_ff}")
    if plan.pp > model.n_layer:
        bad(Reason.PP_LAYERS, f"pp = {plan.pp} > n_layer = {model.n_layer}: a stage needs at least one layer")
    if plan.cp > 1:
        out.extend(Infeasible(plan, reason, detail) for reason, detail in cp_problems(model, job, plan))
    if plan.ep > 1 and (not model.moe_experts or model.moe_experts % plan.ep):
        bad(Reason.EP_EXPERTS, f"ep = {plan.ep} does not divide moe_experts = {model.moe_experts}"
                               + ("" if model.moe_experts else " (a dense model has no experts: use ep = 1)")
                               + ": each expert-parallel rank holds a whole E / ep of every MoE block's experts")
    if job.global_batch % (plan.dp * plan.micro_batch):
        bad(Reason.BATCH, f"global batch {job.global_batch} is not a multiple of dp * micro_batch = "
                          f"{plan.dp} * {plan.micro_batch}")
    elif plan.schedule is PipelineSchedule.INTERLEAVED_1F1B:
        chunks = plan.pp * plan.virtual_stages
        if model.n_layer % chunks or plan.grad_accum(job) % plan.pp:
            bad(Reason.INTERLEAVING, f"interleaved 1F1B needs n_layer = {model.n_layer} divisible by pp * v = "
                                     f"{chunks} and micro-batches {plan.grad_accum(job)} divisible by pp = {plan.pp}")
    return out


def cp_problems(model: GPTConfig, job: JobSpec, plan: Plan) -> list[tuple[Reason, str]]:
    """The engine's context-parallel rules: causal ring attention cuts each sequence into 2 cp chunks (rank i
    holds chunks i and 2cp-1-i), Ulysses into cp parts and gives every rank whole heads of its TP slice, key/value
    heads dividing or divisible by cp (fewer are repeated)."""
    out = []
    seq, c = job.sequence_length(model), plan.cp
    ring = plan.cp_impl is ContextParallelImpl.RING
    chunks = 2 * c if ring else c
    if seq % chunks:
        what = "2 * cp chunks (causal ring attention)" if ring else "cp parts"
        out.append((Reason.CP_SEQUENCE, f"sequence {seq} does not cut into {what} = {chunks}"))
    if not ring:
        assert model.n_kv_head is not None
        heads, kv = model.n_head // plan.tp, max(1, model.n_kv_head // plan.tp)
        if heads % c or (kv % c and c % kv):
            out.append((Reason.CP_HEADS, f"Ulysses over cp = {c} needs the {heads} query heads of a TP rank "
                                         f"divisible by cp and its {kv} key/value heads dividing or divisible by it"))
    return out


def _memory_problem(plan: Plan, mem: MemoryBreakdown) -> Infeasible | None:
    if mem.over_budget > 0:
        return Infeasible(plan, Reason.MEMORY,
                          f"needs {mem.total / GB:.1f} GB > {mem.capacity / GB:.1f} GB, over by "
                          f"{mem.over_budget / GB:.1f} GB (model states {mem.model_states / GB:.1f}, activations "
                          f"{mem.activations / GB:.1f}, buffers {mem.buffers / GB:.1f}, reserved "
                          f"{mem.reserved / GB:.1f})")
    if mem.cpu > mem.host_budget:
        return Infeasible(plan, Reason.HOST_MEMORY,
                          f"offloads {mem.cpu / GB:.1f} GB per GPU to host memory, more than its share "
                          f"{mem.host_budget / GB:.1f} GB")
    return None


def evaluate(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> Evaluation:
    """Memory, step time and problems of one plan."""
    problems = layout_problems(model, cluster, job, plan)
    if any(p.reason in (Reason.BATCH, Reason.PP_LAYERS) for p in problems):
        return Evaluation(plan, None, None, tuple(problems))
    mem = memory_per_rank(model, cluster, job, plan)
    if (p := _memory_problem(plan, mem)) is not None:
        problems.append(p)
    return Evaluation(plan, mem, step_time(model, cluster, job, plan) if not problems else None, tuple(problems))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _variants(zero_stage: int) -> list[list[tuple[Offload, Recompute]]]:
    """Groups tried in order; within a group the first that fits wins (see `search`)."""
    recomputes = list(Recompute)
    groups = [[(Offload.NONE, r) for r in recomputes]]
    if zero_stage >= 1:
        groups.append([(Offload.OPTIMIZER, r) for r in recomputes])
    if zero_stage == 3:
        groups.append([(Offload.OPTIMIZER_AND_PARAMS, r) for r in recomputes])
    return groups


@dataclass
class SearchResult:
    ranked: list[Evaluation]
    """Feasible plans, fastest first."""
    infeasible: list[Infeasible]
    """One entry per layout that cannot run at all: its first broken rule, or the least memory it needs."""
    considered: int = 0
    counts: dict[Reason, int] = field(default_factory=dict)

    @property
    def best(self) -> Evaluation | None:
        return self.ranked[0] if self.ranked else None


def _schedules(pp: int) -> list[tuple[PipelineSchedule, int]]:
    if pp == 1:
        return [(PipelineSchedule.ONE_F_ONE_B, 1)]
    return [(PipelineSchedule.GPIPE, 1), (PipelineSchedule.ONE_F_ONE_B, 1),
            (PipelineSchedule.INTERLEAVED_1F1B, INTERLEAVED_CHUNKS)]


def _rank_key(e: Evaluation) -> tuple:
    # Exact ties (the model has no per-kernel efficiency) go to the simpler plan.
    assert e.time is not None
    return (round(e.time.total_s, 12), simplicity(e.plan))


def search(model: GPTConfig, cluster: ClusterSpec, job: JobSpec) -> SearchResult:
    """Rank every feasible plan on `cluster.num_gpus` GPUs by estimated step time.

    Enumerated: (dp, cp, tp, pp) with dp * cp * tp * pp = GPUs, and for cp > 1 ring attention and Ulysses;
    for an MoE model expert parallelism ep over every divisor of dp that divides its experts;
    micro-batch (divisors of the per-replica batch up to MAX_MICRO_BATCH); pipeline schedule (GPipe, 1F1B,
    interleaved with v = 2); ZeRO stage 0-3; offload; recomputation. Two dominance rules keep it well under a
    second, and are the only pruning:

    - For one layout, micro-batch, schedule and ZeRO stage, recomputation is tried in the order none ->
      selective -> full and offload only when nothing fits without it (`_variants`): each step down costs time
      in the model and only buys memory, so the first variant that fits is the fastest.
    - With tp > 1, sequence parallelism is always on: the same communication volume (Korthikanti et al. 2022)
      and strictly less activation memory.

    And one rule of use: context parallelism is searched only for a (tp, pp) where no plan without it runs
    (the sequence does not fit, or the global batch does not divide over dp * cp replicas). Against the same
    ranks as data parallelism it computes the same tokens per rank, reduces gradients over the same dp * cp
    replicas and keeps the same model states, and adds its own traffic; what it buys is memory (a rank holds
    S / cp of each sequence) and a smaller dp for the batch to divide.
    """
    result = SearchResult(ranked=[], infeasible=[])
    n = cluster.num_gpus
    runs: set[tuple[int, int]] = set()     # (tp, pp) that some cp = 1 plan runs with
    for cp in _divisors(n):
        impls = [ContextParallelImpl.RING] if cp == 1 else list(ContextParallelImpl)
        for impl in impls:
            for tp in _divisors(n // cp):
                for pp in _divisors(n // (cp * tp)):
                    if cp > 1 and (tp, pp) in runs:
                        continue
                    dp = n // (cp * tp * pp)
                    for ep in _expert_parallel_sizes(model, dp):
                        base = Plan(dp=dp, tp=tp, pp=pp, cp=cp, cp_impl=impl, sequence_parallel=tp > 1, ep=ep)
                        problems = layout_problems(model, cluster, job, base)
                        if problems:
                            result.infeasible.append(problems[0])
                            for p in problems:
                                result.counts[p.reason] = result.counts.get(p.reason, 0) + 1
                            continue
                        if _search_layout(model, cluster, job, base, result) and cp == 1:
                            runs.add((tp, pp))
    result.ranked.sort(key=_rank_key)
    return result


def _expert_parallel_sizes(model: GPTConfig, dp: int) -> list[int]:
    """ep sizes to try: 1, and for an MoE model every divisor of dp that divides the experts."""
    return [ep for ep in _divisors(dp) if model.moe_experts % ep == 0] if model.moe_experts else [1]


def _variant(plan: Plan, **changes: object) -> Plan:
    """`plan.replace(**changes)` without re-validation: the search only combines values that
    `_schedules` and `_variants` produce, which are valid together (Plan's own checks cost more than
    the rest of an evaluation)."""
    new = object.__new__(Plan)
    new.__dict__.update(plan.__dict__, **changes)
    return new


def _search_layout(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, base: Plan, result: SearchResult) -> bool:
    """Add the feasible plans of one (dp, cp, tp, pp) layout (True if any); if there are none, its closest miss.
    Micro-batches grow until none of a size fits: memory only grows with the micro-batch."""
    closest: tuple[float, Plan, MemoryBreakdown] | None = None
    found = False
    for mb in (d for d in _divisors(job.global_batch // base.dp) if d <= MAX_MICRO_BATCH):
        fitted_mb = False
        for schedule, v in _schedules(base.pp):
            shaped = _variant(base, micro_batch=mb, schedule=schedule, virtual_stages=v)
            problems = layout_problems(model, cluster, job, shaped)
            if problems:
                for p in problems:
                    result.counts[p.reason] = result.counts.get(p.reason, 0) + 1
                fitted_mb = True    # not a memory verdict: keep growing the micro-batch
                continue
            for stage in range(4):
                for group in _variants(stage):
                    fitted = False
                    for offload, recompute in group:
                        plan = _variant(shaped, zero_stage=stage, offload=offload, recompute=recompute)
                        result.considered += 1
                        mem = memory_per_rank(model, cluster, job, plan)
                        if mem.fits:
                            result.ranked.append(Evaluation(plan, mem, step_time(model, cluster, job, plan)))
                            fitted = fitted_mb = found = True
                            break
                        reason = Reason.MEMORY if mem.over_budget > 0 else Reason.HOST_MEMORY
                        result.counts[reason] = result.counts.get(reason, 0) + 1
                        over = max(mem.over_budget, mem.cpu - mem.host_budget)
                        if closest is None or over < closest[0]:
                            closest = (over, plan, mem)
                    if fitted:
                        break
        if not fitted_mb:
            break
    if not found and closest is not None:
        problem = _memory_problem(closest[1], closest[2])
        assert problem is not None
        result.infeasible.append(problem)
    return found


TIE_TOLERANCE = 0.03
"""Plans within 3% of the fastest estimate are treated as equally fast: the model cannot rank them."""


def simplicity(plan: Plan) -> tuple:
    """Fewer model-parallel ranks (tp, pp and cp: cp is used only when it pays), no offload, less recomputation,
    lower ZeRO stage, bigger micro-batch."""
    return (plan.tp * plan.pp * plan.cp, plan.offload is not Offload.NONE, list(Recompute).index(plan.recompute),
            plan.zero_stage, -plan.micro_batch)


def recommend(result: SearchResult, tolerance: float = TIE_TOLERANCE) -> Evaluation | None:
    """The simplest plan among those within `tolerance` of the fastest estimate."""
    best = result.best
    if best is None or best.time is None:
        return None
    limit = best.time.total_s * (1 + tolerance)
    near = [e for e in result.ranked if e.time is not None and e.time.total_s <= limit]
    return min(near, key=lambda e: (simplicity(e.plan), e.time.total_s if e.time else 0.0))
