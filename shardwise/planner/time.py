"""Step time of a plan (`step_time`: the slowest pipeline stage's compute and communication, exposed data-parallel
traffic, the optimizer step, offload), time to train, utilisation and scaling efficiency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.config import PipelineSchedule
from shardwise.config.schema import ContextParallelImpl
from shardwise.models.presets import GPTConfig
from shardwise.parallel.pipeline.schedules import bubble_microbatches
from shardwise.planner.comm import Axis, Collective, Op, step_collectives
from shardwise.planner.flops import (
    busiest_rank_params, forward_flops, layer_params, moe_blocks_per_stage, moe_params, stage_layers, training_flops,
)
from shardwise.planner.kernels import block_parts, embedding_parts, head_parts
from shardwise.planner.memory import FP32_BYTES, REDUCE_BUCKET_ELEMENTS, state_bytes_per_param
from shardwise.planner.specs import ClusterSpec, JobSpec, Offload, Plan, PlannerError, Recompute
from shardwise.planner.zero3 import Zero3Shape, exposed_seconds
from shardwise.planner.zero3 import shape_of as zero3_shape


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
    hardware_flops: float = 0.0   # the FLOPs executed, recomputation included (flops.py's conventions)
    cp_comm_s: float = 0.0        # context-parallel traffic not hidden behind attention (`cp_exposed_seconds`)
    ep_comm_s: float = 0.0        # expert-parallel all-to-alls (dispatch and combine), all exposed

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tp_comm_s + self.pp_comm_s + self.cp_comm_s + self.ep_comm_s + self.bubble_s
                + self.dp_exposed_s + self.optimizer_s + self.offload_s)

    @property
    def compute_share(self) -> float:
        """Compute over step time: weak-scaling efficiency against one GPU doing this GPU's work with
        no communication, bubble or optimizer step."""
        return self.compute_s / self.total_s if self.total_s > 0 else 0.0


def _dp_exposed(dp: list[Collective], plan: Plan, m: int, mb: "MicrobatchCompute", overlap: bool,
                share: float, zero3: Zero3Shape | None = None) -> float:
    """Data-parallel communication left on the critical path; `share` of what could hide does (the cluster's
    `comm_overlap`: CPU ranks whose collectives need the cores the compute runs on hide almost nothing).

    With `overlap` (`JobSpec.overlap_dp_comm`) gradients are reduced in k buckets, each launched when the backward
    has produced it, one after the other, so of c seconds of reduction max(c / k, c - (k - 1) / k * backward)
    stay exposed (one bucket: all of it). ZeRO-1/2's all-gather of updated parameters follows the optimizer step
    and is never hidden. ZeRO-3 (zero3.py): gathers hide by prefetch behind the block before, as deep as the
    prefetch bucket allows; reduce-scatters only when `overlap`."""
    if not dp:
        return 0.0
    if plan.zero_stage == 3:
        assert zero3 is not None
        # expert parameters (under ep) are gathered and reduced over their own group, unit by unit beside the rest
        gather = sum(c.seconds for c in dp if c.op is Op.ALL_GATHER)
        reduce = sum(c.seconds for c in dp if c.op is Op.REDUCE_SCATTER)
        return m * exposed_seconds(gather_s=gather, reduce_s=reduce, block_share=zero3.block_share,
                                   layers=zero3.layers, forward_s=mb.block_forward_s,
                                   backward_s=mb.block_backward_s, depth=zero3.depth,
                                   overlap_reduce=overlap, share=share)
    if not overlap:
        return sum(c.total_seconds for c in dp)
    exposed = 0.0
    for c in dp:
        if c.op is Op.ALL_GATHER:   # ZeRO-1/2: gather the updated shards after the step
            exposed += c.total_seconds
        else:
            # k buckets, the i-th ready at i/k of the backward, reduced one at a time: the last finishes at
            # max(backward + c/k, backward/k + c), so at most (k - 1)/k of min(c, backward) hides
            k = c.messages
            exposed += c.calls * (c.seconds - share * min(c.seconds, mb.backward_s) * (k - 1) / k)
    return exposed


@dataclass(frozen=True)
class MicrobatchCompute:
    """Seconds of one micro-batch's forward + backward (+ recomputation) on the slowest pipeline stage, by
    part, and every stage's total."""

    matmul_s: float
    attention_s: float
    pointwise_s: float
    operators_s: float
    backward_s: float      # the part of the total that is backward (the overlap window of gradient reduction)
    stages_s: tuple[float, ...] = ()
    block_forward_s: float = 0.0    # one transformer block, forward (the window a ZeRO-3 prefetch hides in)
    block_backward_s: float = 0.0   # and backward with any recomputation

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.attention_s + self.pointwise_s + self.operators_s


def microbatch_compute(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> MicrobatchCompute:
    """Compute of one micro-batch per pipeline stage (kernels.py): each stage runs its blocks (the
    partitioner's `stage_layers`), the first also the embedding, the last the final norm, the logits and the
    loss; the slowest stage is reported by part."""
    block = block_parts(model, cluster, job, plan)
    moe_block = block_parts(model, cluster, job, plan, moe=True) if model.moe_experts else block
    layers, moe_layers = stage_layers(model.n_layer, plan.pp), moe_blocks_per_stage(model, plan.pp)
    first, last = embedding_parts(model, cluster, job, plan), head_parts(model, cluster, job, plan)
    stages = []
    for i, n in enumerate(layers):
        stage = block * (n - moe_layers[i]) + moe_block * moe_layers[i]
        if i == 0:
            stage = stage + first
        if i == len(layers) - 1:
            stage = stage + last
        stages.append(stage)
    slowest = max(stages, key=lambda p: p.total_s)
    # backward is 2/3 of forward + backward; a recomputed forward runs inside the backward too
    backward_share = 2 / 3 if plan.recompute is Recompute.NONE else 3 / 4
    forward_share = 1 / 3 if plan.recompute is Recompute.NONE else 1 / 4
    return MicrobatchCompute(slowest.matmul_s, slowest.attention_s, slowest.pointwise_s, slowest.operators_s,
                             backward_s=backward_share * slowest.total_s,
                             stages_s=tuple(p.total_s for p in stages),
                             block_forward_s=forward_share * moe_block.total_s,
                             block_backward_s=backward_share * moe_block.total_s)


def cp_exposed_seconds(cp: list[Collective], plan: Plan, m: int, mb: MicrobatchCompute, share: float) -> float:
    """Context-parallel traffic of the step left on the critical path; `share` of what could hide does (the
    cluster's `comm_overlap`).

    Ring attention posts round t's send before attending to the block it holds, so the traffic of c - 1 of its c
    rounds runs under attention: per micro-batch, of k seconds of sends, min(k, (c - 1) / c * attention) can
    hide (attention: the slowest stage's attention core, every pass). Ulysses' all-to-alls are not overlapped:
    the attention needs what they bring, and the next layer the output they return."""
    if not cp:
        return 0.0
    total = sum(c.total_seconds for c in cp)
    if plan.cp_impl is not ContextParallelImpl.RING:
        return total
    per_mb = total / m
    hidden = share * min(per_mb, (plan.cp - 1) / plan.cp * mb.attention_s)
    return m * (per_mb - hidden)


def param_tensor_sizes(model: GPTConfig, *, tp: int = 1, pp: int = 1, ep: int = 1) -> list[int]:
    """Elements of each parameter tensor of the busiest rank (what a for-loop optimizer steps one by one at
    stage 0), laid out as `flops.params_per_stage`: its stage's blocks, TP slices of the split weights, the
    first stage's tables, the last stage's final norm and head (a copy of a tied table when pp > 1)."""
    d, kv, f, b = model.d_model, model.kv_dim, model.d_ff, model.bias
    assert f is not None
    mlp_in = 2 if model.mlp == "swiglu" else 1
    column = [d, kv, kv] + [f] * mlp_in                        # q, k, v, MLP input: split over TP
    norm = [d, d] if model.norm == "layernorm" and b else [d]
    block = [math.ceil(n * d / tp) for n in column] + [math.ceil(d * d / tp), math.ceil(f * d / tp)] + 2 * norm
    if b:
        block += [math.ceil(n / tp) for n in column] + [d, d]   # column biases split; o, MLP-output replicated
    table = math.ceil(model.vocab_size / tp) * d
    moe = moe_params(model)
    if moe.layers:   # an MoE block: the dense MLP's tensors give way to the router, E / ep experts, shared experts
        w = model.moe_d_ff
        assert w is not None

        def mlp_tensors(width: int) -> list[int]:   # weights (input, gate, output), then the biases
            return ([math.ceil(width * d / tp)] * (mlp_in + 1)
                    + ([math.ceil(width / tp)] * mlp_in + [d] if b else []))

        moe_block = list(block)
        for n in mlp_tensors(f):
            moe_block.remove(n)
        shared = mlp_tensors(model.moe_shared_experts * w) if model.moe_shared_experts else []
        moe_block += [d * moe.experts] + mlp_tensors(w) * (moe.experts // ep) + shared
    stages = [block * (n - k) + (moe_block * k if k else [])
              for n, k in zip(stage_layers(model.n_layer, pp), moe_blocks_per_stage(model, pp))]
    stages[0] += [table] + ([model.seq_len * d] if model.positions == "learned" else [])
    stages[-1] += norm + ([table] if not model.tie_embeddings or pp > 1 else [])
    return max(stages, key=sum)


def optimizer_tensor_sizes(model: GPTConfig, plan: Plan) -> list[int]:
    """Elements of each tensor the optimizer steps on the busiest rank: its parameters at stage 0; the shard
    of each reduce bucket at stages 1-2; the shard of each ZeRO-3 unit (every block, and the rest) at stage 3."""
    if plan.zero_stage == 0:
        return param_tensor_sizes(model, tp=plan.tp, pp=plan.pp, ep=plan.ep)
    dense, experts = busiest_rank_params(model, tp=plan.tp, pp=plan.pp, ep=plan.ep)
    if plan.zero_stage in (1, 2):   # expert parameters fill buckets of their own, sharded over their group
        out = []
        for psi, replicas in ((dense, plan.replicas), (experts, plan.expert_replicas)):
            if psi:
                buckets = math.ceil(psi / REDUCE_BUCKET_ELEMENTS)
                out += [math.ceil(psi / buckets / replicas)] * buckets
        return out
    layers = stage_layers(model.n_layer, plan.pp)[0]
    block = layer_params(model).per_tp_rank(plan.tp)
    out = ([math.ceil(block / plan.replicas)] * layers
           + [math.ceil(max(0, dense - layers * block) / plan.replicas)])
    moe_layers = moe_blocks_per_stage(model, plan.pp)[0]
    if moe_layers:   # each MoE unit also has a flat of its experts, sharded over the expert-dp group
        out += [math.ceil(experts / moe_layers / plan.expert_replicas)] * moe_layers
    return out


def optimizer_seconds(sizes: list[int], job: JobSpec, cluster: ClusterSpec, bandwidth: float) -> float:
    """Each tensor: a fixed cost (`optimizer_tensor_s`; each parameter at stage 0, each flat shard under ZeRO),
    then its states streamed once at `bandwidth` (memory-bound: Adam reads gradient, master, m, v and writes
    master, m, v and the 16-bit weight, 28 bytes per parameter), or at the cache's when its weight, gradient and
    states fit there."""
    resident = sum(state_bytes_per_param(job.precision, job.optimizer))     # weight, gradient, K
    in_cache = sum(n for n in sizes if n * resident <= cluster.cache_bytes) if cluster.cache_bw > 0 else 0
    per_param = optimizer_step_bytes(job)
    return (len(sizes) * cluster.optimizer_tensor_s + (sum(sizes) - in_cache) * per_param / bandwidth
            + (in_cache * per_param / cluster.cache_bw if in_cache else 0.0))


def optimizer_step_bytes(job: JobSpec) -> int:
    """Bytes the optimizer reads and writes per parameter: the gradient, its states read and written
    (K, the master inside it under mixed precision), and the weight (read and written in fp32, written
    once in 16-bit)."""
    w, g, k = state_bytes_per_param(job.precision, job.optimizer)
    return g + 2 * k + (w if job.precision.mixed else 2 * w)


def step_time(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> StepTime:
    """Estimated seconds of one optimizer step of `plan`; memory is not checked here. As seen by the slowest
    pipeline stage:

        t_i      = stage i's compute of one micro-batch (kernels.py) + its TP collectives + its pipeline sends
        pipeline = m * max_i t_i + (sum_i t_i - max_i t_i) / v    (Narayanan's (m + (p - 1) / v) t for equal
                                                                  stages and m >= p)
        step     = pipeline + exposed data-parallel communication + optimizer step + offload traffic

    Each stage runs its blocks (the partitioner's `stage_layers`), the first also the embedding, the last the
    final norm, the logits and the loss (`microbatch_compute`)."""
    m = plan.grad_accum(job)
    if m < 1 or m * plan.dp * plan.micro_batch != job.global_batch:
        raise PlannerError(f"step_time: global batch {job.global_batch} is not a multiple of dp * micro_batch = "
                           f"{plan.dp} * {plan.micro_batch}; every step must split into whole micro-batches")
    mb = microbatch_compute(model, cluster, job, plan)
    compute_mb = mb.total_s

    collectives = step_collectives(model, cluster, job, plan)
    tp = sum(c.total_seconds for c in collectives if c.axis is Axis.TP)
    pp = sum(c.total_seconds for c in collectives if c.axis is Axis.PP)
    cp = cp_exposed_seconds([c for c in collectives if c.axis is Axis.CP], plan, m, mb, cluster.comm_overlap)
    ep = sum(c.total_seconds for c in collectives if c.axis is Axis.EP)
    dp = [c for c in collectives if c.axis is Axis.DP]
    comm_mb = (tp + pp + cp + ep) / m
    t_mb = compute_mb + comm_mb
    # The slowest stage sets the pace of all m micro-batches. Filling and draining the pipeline costs one
    # micro-batch of every other stage, `fill` ((p - 1) t for equal stages), divided by v when interleaved;
    # `stretch` is the schedule's bubble over that one: 1, or more when interleaving fewer micro-batches than stages.
    v = plan.virtual_stages if plan.schedule is PipelineSchedule.INTERLEAVED_1F1B else 1
    fill = sum(mb.stages_s) - compute_mb + (plan.pp - 1) * comm_mb
    stretch = bubble_microbatches(plan.schedule, num_stages=plan.pp, num_microbatches=m,
                                  virtual_stages=plan.virtual_stages) * v / (plan.pp - 1) if plan.pp > 1 else 1
    pipeline = m * t_mb + fill / v * float(stretch)
    zero3 = zero3_shape(model, job, plan) if plan.zero_stage == 3 else None

    dense, experts = busiest_rank_params(model, tp=plan.tp, pp=plan.pp, ep=plan.ep)
    shard = (math.ceil(dense / plan.replicas) + math.ceil(experts / plan.expert_replicas) if plan.zero_stage >= 1
             else dense + experts)
    sizes = optimizer_tensor_sizes(model, plan)
    optimizer_s, offload_s = optimizer_seconds(sizes, job, cluster, cluster.memory_bw), 0.0
    if plan.offload is not Offload.NONE:
        w = job.precision.nbytes
        pcie = shard * (FP32_BYTES + w)          # fp32 gradient shard down, updated 16-bit shard up
        if plan.offload is Offload.OPTIMIZER_AND_PARAMS:
            pcie += 2 * m * shard * w            # the shard is fetched for every forward and backward
        # the node's GPUs share the host's bandwidth
        cpu_step = optimizer_seconds(sizes, job, cluster, cluster.host_memory_bw / cluster.gpus_per_node)
        optimizer_s, offload_s = 0.0, pcie / cluster.pcie_bw + cpu_step

    fwd = forward_flops(model, batch=plan.micro_batch, seq_len=job.sequence_length(model), causal=job.causal_flops)
    return StepTime(
        microbatches=m, compute_s=m * compute_mb, tp_comm_s=tp, pp_comm_s=pp, cp_comm_s=cp, ep_comm_s=ep,
        bubble_s=pipeline - m * t_mb,
        dp_comm_s=sum(c.total_seconds for c in dp),
        dp_exposed_s=_dp_exposed(dp, plan, m, mb, job.overlap_dp_comm, cluster.comm_overlap, zero3),
        optimizer_s=optimizer_s, offload_s=offload_s,
        model_flops=training_flops(fwd) * job.global_batch / plan.micro_batch,   # all terms are linear in b
        hardware_flops=training_flops(fwd, plan.recompute) * job.global_batch / plan.micro_batch,
    )


def pipeline_seconds(*, microbatch_seconds: float, stages: int, microbatches: int,
                     schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B, virtual_stages: int = 1) -> float:
    """Iteration time of equal stages ignoring data-parallel communication: (m + (p - 1) / v) t when m >= p
    (Narayanan eq. 1), the bubble in general as `schedules.bubble_microbatches` counts it."""
    bubble = bubble_microbatches(schedule, num_stages=stages, num_microbatches=microbatches,
                                 virtual_stages=virtual_stages)
    return float(microbatches + bubble) * microbatch_seconds


def mfu(step: StepTime, cluster: ClusterSpec, job: JobSpec, num_gpus: int) -> float:
    """Model FLOPs utilisation: useful FLOPs per second over the peak of all GPUs."""
    return step.model_flops / (step.total_s * num_gpus * cluster.peak_flops(job.precision))


def hfu(step: StepTime, cluster: ClusterSpec, job: JobSpec, num_gpus: int) -> float:
    """Hardware FLOPs utilisation: the FLOPs executed, recomputation included (the published "% of peak" of
    Narayanan et al. 2021 with full recomputation), per second over the peak of all GPUs; >= MFU."""
    return step.hardware_flops / (step.total_s * num_gpus * cluster.peak_flops(job.precision))


def steps_to_train(job: JobSpec, model: GPTConfig, num_params: int) -> float:
    return job.total_tokens(num_params) / (job.global_batch * job.sequence_length(model))


# -- scaling: strong and weak efficiency, Amdahl's law ---------------------------------------------

def strong_scaling_efficiency(t1: float, tn: float, n: int) -> float:
    """Fixed total problem: t_1 / (N t_N) = speedup / N."""
    return t1 / (n * tn)


def weak_scaling_efficiency(t1: float, tn: float) -> float:
    """Fixed work per processor: t_1 / t_N."""
    return t1 / tn


def amdahl_speedup(parallel_fraction: float, n: int) -> float:
    return 1.0 / ((1.0 - parallel_fraction) + parallel_fraction / n)
