"""Step time of a plan, time to train, utilisation and scaling efficiency.

One step, as seen by the busiest rank:

    t_mb     = hardware FLOPs of one micro-batch / (tp * pp) / (peak * efficiency)     compute
             + its TP collectives + its pipeline sends                                  (synchronous)
    pipeline = (m + (p - 1) / v) * t_mb                                                  (bubble.py)
    step     = pipeline + exposed data-parallel communication + optimizer step + offload traffic

Data-parallel communication hides behind backward when `JobSpec.overlap_dp_comm`: the gradient reduction
of stages 0-2 behind the backward of the micro-batch that produces it, ZeRO-3's gathers behind each
micro-batch's compute (prefetch); ZeRO-1/2's all-gather of updated parameters follows the optimizer step
and is never hidden. The optimizer step streams its states once (memory-bandwidth bound): Adam reads
gradient, master, m, v and writes master, m, v and the 16-bit weight, 28 bytes per parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.planner.bubble import pipeline_seconds
from shardwise.planner.comm import Axis, Collective, Op, step_collectives
from shardwise.planner.flops import forward_flops, params_per_rank, training_flops
from shardwise.planner.memory import FP32_BYTES, state_bytes_per_param
from shardwise.planner.specs import ClusterSpec, JobSpec, ModelSpec, Offload, Plan, PlannerError


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by part; `total_s` is what the search ranks."""

    microbatches: int
    compute_s: float       # all micro-batches' matmuls, recomputation included, no bubble
    tp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    dp_comm_s: float       # data-parallel collectives if nothing overlapped
    dp_exposed_s: float    # the part not hidden behind compute
    optimizer_s: float
    offload_s: float       # PCIe traffic and the CPU optimizer step
    model_flops: float     # the whole job's useful FLOPs per step (no recomputation)

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tp_comm_s + self.pp_comm_s + self.bubble_s + self.dp_exposed_s
                + self.optimizer_s + self.offload_s)

    @property
    def compute_share(self) -> float:
        """Compute over step time: weak-scaling efficiency against one GPU doing this GPU's work with
        no communication, bubble or optimizer step."""
        return self.compute_s / self.total_s if self.total_s > 0 else 0.0


def _exposed(seconds: float, window: float) -> float:
    return max(0.0, seconds - window)


def _dp_exposed(dp: list[Collective], plan: Plan, m: int, compute_mb: float, backward_mb: float,
                overlap: bool) -> float:
    if not overlap:
        return sum(c.total_seconds for c in dp)
    if plan.zero_stage == 3:   # every micro-batch: gather twice, reduce-scatter once, behind its compute
        return m * _exposed(sum(c.total_seconds for c in dp) / m, compute_mb)
    exposed = 0.0
    for c in dp:
        if c.op is Op.ALL_GATHER:   # ZeRO-1/2: gather the updated shards after the step
            exposed += c.total_seconds
        else:                       # gradient reduction behind the backward that produced it
            exposed += c.calls * _exposed(c.seconds, backward_mb)
    return exposed


def optimizer_step_bytes(job: JobSpec) -> int:
    """Bytes the optimizer reads and writes per parameter: the gradient, its states read and written
    (K, the master inside it under mixed precision), and the weight (read and written in fp32, written
    once in 16-bit)."""
    w, g, k = state_bytes_per_param(job.precision, job.optimizer)
    return g + 2 * k + (w if job.precision.mixed else 2 * w)


def step_time(model: ModelSpec, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> StepTime:
    """Estimated seconds of one optimizer step of `plan` (module notes); memory is not checked here."""
    s, m = job.sequence_length(model), plan.grad_accum(job)
    if m < 1 or m * plan.dp * plan.micro_batch != job.global_batch:
        raise PlannerError(f"step_time: global batch {job.global_batch} is not a multiple of dp * micro_batch = "
                           f"{plan.dp} * {plan.micro_batch}; every step must split into whole micro-batches")
    achieved = cluster.peak_flops(job.precision) * cluster.compute_efficiency
    fwd = forward_flops(model, batch=plan.micro_batch, seq_len=s, causal=job.causal_flops)
    per_gpu = achieved * plan.tp * plan.pp
    compute_mb = training_flops(fwd, plan.recompute) / per_gpu
    backward_mb = compute_mb - fwd.total / per_gpu

    collectives = step_collectives(model, cluster, job, plan)
    tp = sum(c.total_seconds for c in collectives if c.axis is Axis.TP)
    pp = sum(c.total_seconds for c in collectives if c.axis is Axis.PP)
    dp = [c for c in collectives if c.axis is Axis.DP]
    t_mb = compute_mb + (tp + pp) / m
    pipeline = pipeline_seconds(microbatch_seconds=t_mb, stages=plan.pp, microbatches=m,
                                schedule=plan.schedule, virtual_stages=plan.virtual_stages)

    psi = params_per_rank(model, tp=plan.tp, pp=plan.pp)
    shard = math.ceil(psi / plan.dp) if plan.zero_stage >= 1 else psi
    step_bytes = shard * optimizer_step_bytes(job)
    optimizer_s, offload_s = step_bytes / cluster.memory_bw, 0.0
    if plan.offload is not Offload.NONE:
        w = job.precision.nbytes
        pcie = shard * (FP32_BYTES + w)          # fp32 gradient shard down, updated 16-bit shard up
        if plan.offload is Offload.OPTIMIZER_AND_PARAMS:
            pcie += 2 * m * shard * w            # the shard is fetched for every forward and backward
        cpu_step = step_bytes * cluster.gpus_per_node / cluster.host_memory_bw   # the node's GPUs share it
        optimizer_s, offload_s = 0.0, pcie / cluster.pcie_bw + cpu_step

    return StepTime(
        microbatches=m, compute_s=m * compute_mb, tp_comm_s=tp, pp_comm_s=pp,
        bubble_s=pipeline - m * t_mb,
        dp_comm_s=sum(c.total_seconds for c in dp),
        dp_exposed_s=_dp_exposed(dp, plan, m, compute_mb, backward_mb, job.overlap_dp_comm),
        optimizer_s=optimizer_s, offload_s=offload_s,
        model_flops=training_flops(fwd) * job.global_batch / plan.micro_batch,   # all terms are linear in b
    )


def mfu(step: StepTime, cluster: ClusterSpec, job: JobSpec, num_gpus: int) -> float:
    """Model FLOPs utilisation: useful FLOPs per second over the peak of all GPUs."""
    return step.model_flops / (step.total_s * num_gpus * cluster.peak_flops(job.precision))


def steps_to_train(job: JobSpec, model: ModelSpec, num_params: int) -> float:
    return job.total_tokens(num_params) / (job.global_batch * job.sequence_length(model))


# -- scaling (formulas.md A8) ----------------------------------------------------------------------

def strong_scaling_efficiency(t1: float, tn: float, n: int) -> float:
    """Fixed total problem: t_1 / (N t_N) = speedup / N."""
    return t1 / (n * tn)


def weak_scaling_efficiency(t1: float, tn: float) -> float:
    """Fixed work per processor: t_1 / t_N."""
    return t1 / tn


def amdahl_speedup(parallel_fraction: float, n: int) -> float:
    return 1.0 / ((1.0 - parallel_fraction) + parallel_fraction / n)
