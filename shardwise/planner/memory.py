"""Memory of one GPU: model states per ZeRO stage and offload (Rajbhandari et al. 2020), activations per layer
with TP, SP and recomputation (Korthikanti et al. 2022), communication and ZeRO-3 buffers, and the reserve.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardwise.config import PipelineSchedule, ZeroConfig
from shardwise.config.schema import ContextParallelImpl
from shardwise.config.resolved import LAST_BUCKET_DIVISOR, gradient_bucket_numel
from shardwise.models.presets import GPTConfig
from shardwise.planner.flops import busiest_rank_params, stage_layers
from shardwise.planner.zero3 import buffer_elements as zero3_buffer_elements
from shardwise.planner.specs import (
    ClusterSpec, JobSpec, Offload, Optimizer, Plan, PlannerError, Precision, Recompute,
)

GB = 1e9
REDUCE_BUCKET_ELEMENTS: int = ZeroConfig.model_fields["reduce_bucket_size"].default
"""DeepSpeed's default zero_optimization.reduce_bucket_size: the gradient bucket ZeRO-1/2 fill and reduce."""
FP32_BYTES = 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def gradient_buckets(psi: int, job: JobSpec, plan: Plan) -> int:
    """Gradient buckets of `psi` elements per step, of the size the engine resolves for a config without
    reduce_bucket_size (stage 0: 25 MB of gradients in the job's dtype, the last a quarter of it; ZeRO-1/2: 5e8
    elements)."""
    numel = gradient_bucket_numel(None, zero_stage=plan.zero_stage, element_size=job.precision.nbytes)
    if plan.zero_stage == 0:        # the last bucket holds a quarter of the size, the rest are split greedily
        last = max(numel // LAST_BUCKET_DIVISOR, 1)
        return 1 + _ceil_div(max(psi - last, 0), numel)
    return _ceil_div(psi, numel)


def state_bytes_per_param(precision: Precision, optimizer: Optimizer) -> tuple[int, int, int]:
    """(weights, grads, optimizer) bytes per parameter before sharding: (2, 2, 12) for mixed-precision Adam."""
    return precision.nbytes, precision.nbytes, optimizer.state_bytes(precision)


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states on one GPU, and what that GPU keeps in host memory under offload."""

    weights: int
    grads: int
    optimizer: int
    cpu: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def model_state_bytes(num_params: int, *, precision: Precision = Precision.BF16,
                      optimizer: Optimizer = Optimizer.ADAM, zero_stage: int = 0, dp: int = 1,
                      offload: Offload = Offload.NONE) -> ModelStates:
    """The ZeRO paper's formulas (sections 3.1 and 5): baseline (2 + 2 + K) psi; P_os 4 psi + K psi / N_d; P_os+g
    2 psi + (2 + K) psi / N_d; P_os+g+p (4 + K) psi / N_d. Per parameter, weights w = 2 (bf16/fp16) or 4 (fp32),
    grads g = w, optimizer K (Adam: 12 mixed = fp32 master + m + v, 8 in fp32 where the weights are the master).
    ZeRO-1 shards K over dp, ZeRO-2 also g, ZeRO-3 also w; a shard is ceil(psi / dp) (padded, as ZeRO pads).

    Offloading the optimizer moves the K part and an fp32 copy of the gradient shard to host memory
    (ZeRO-Offload steps on the CPU); offloading parameters (stage 3) moves the weight shard as well."""
    w, g, k = state_bytes_per_param(precision, optimizer)
    shard = _ceil_div(num_params, dp)
    weights = w * (shard if zero_stage >= 3 else num_params)
    grads = g * (shard if zero_stage >= 2 else num_params)
    states = k * (shard if zero_stage >= 1 else num_params)
    cpu = 0
    if offload is not Offload.NONE:
        cpu, states = states + FP32_BYTES * shard, 0
    if offload is Offload.OPTIMIZER_AND_PARAMS:
        cpu, weights = cpu + weights, 0
    return ModelStates(weights=weights, grads=grads, optimizer=states, cpu=cpu)


def plan_model_states(model: GPTConfig, job: JobSpec, plan: Plan) -> ModelStates:
    """Model states of the most loaded rank: its non-expert parameters sharded (by the ZeRO stage) over all
    `replicas`, its E / ep experts of each MoE block over the `expert_replicas` holding the same experts."""
    dense, experts = busiest_rank_params(model, tp=plan.tp, pp=plan.pp, ep=plan.ep)
    def states(params: int, dp: int) -> ModelStates:
        return model_state_bytes(params, precision=job.precision, optimizer=job.optimizer,
                                 zero_stage=plan.zero_stage, dp=dp, offload=plan.offload)

    a = states(dense, plan.replicas)
    if not experts:
        return a
    b = states(experts, plan.expert_replicas)
    return ModelStates(weights=a.weights + b.weights, grads=a.grads + b.grads, optimizer=a.optimizer + b.optimizer,
                       cpu=a.cpu + b.cpu)


def max_trainable_params(memory_bytes: float, *, precision: Precision = Precision.BF16,
                         optimizer: Optimizer = Optimizer.ADAM, zero_stage: int = 0, dp: int = 1) -> float:
    """Largest psi whose model states fit in `memory_bytes` (ZeRO paper Table 2's theory columns)."""
    w, g, k = state_bytes_per_param(precision, optimizer)
    per_param = ((w / dp if zero_stage >= 3 else w) + (g / dp if zero_stage >= 2 else g)
                 + (k / dp if zero_stage >= 1 else k))
    return memory_bytes / per_param


# -- activations -----------------------------------------------------------------------------------

def layer_activation_bytes(model: GPTConfig, *, micro_batch: int, seq_len: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: Recompute = Recompute.NONE,
                           act_bytes: int = 2, flash_attention: bool = False, cp: int = 1,
                           cp_impl: ContextParallelImpl = ContextParallelImpl.RING) -> float:
    """Bytes one transformer layer keeps for backward, for one micro-batch on one TP rank.

    For activation dtype size e (`act_bytes`, 2 in the paper), 1-byte dropout masks, s = sequence,
    b = micro-batch, h = hidden, f = d_ff, kv = key/value width, a = heads, t = tensor-parallel size. For e = 2,
    f = 4h, kv = h this is Korthikanti et al.'s s b h (34 + 5 a s / h), and under TP their eq. 2,
    s b h (10 + 24/t + 5 a s / (h t)):

        replicated over TP  s b h (2e LayerNorm inputs + e QKV input + e MLP input + 2 dropout masks) = 10 sbh
        split over TP       s b (e h (Q) + 2 e h (K, V) + e h (output-projection input))              =  8 sbh
                            + MLP: GELU 2 e s b f (activation input, output), SwiGLU 4 e s b f (gate, up,
                              silu(gate), product)                                                   = 16 sbh
                            + scores a s^2 b (e softmax + 1 mask + e dropout output)                   = 5as^2b

    Sequence parallelism splits the replicated part over t too (eq. 4); selective recomputation drops the
    scores (eq. 6); full recomputation keeps only the layer input, e s b h (/ t with SP).

    What the Llama form and fused attention add (as our GPT saves them): grouped-query K and V are repeated to
    the query heads before attention, so they are stored at width h, not kv; RMSNorm keeps its input in fp32
    besides the normalised copy, 4 s b h more per norm; rotary positions keep fp32 cos and sin tables, 8 s d
    per layer (d = head dim, whatever b); a fused kernel (`flash_attention`) keeps the fp32 log-sum-exp of every
    query row, 4 a s b, and its output is the output projection's input.

    An MoE model is counted at its MoE block's figure in every layer (the larger one): the MLP terms with
    f = (k + shared) moe_d_ff, plus the k rows per token an expert takes in and gives back, 2 e s b k h, and the
    router's fp32 logits and scores, 8 s b E. Expert parallelism does not change it: a rank's experts receive
    k rows per local token on average.

    Context parallelism over c ranks (`cp`) gives each rank s / c of every sequence's tokens, so every
    per-token term above is taken at s / c. The scores are not: ring attention (`cp_impl` "ring") computes one
    [s/c, s/c] block at a time and stores none of them (its backward recomputes them from q, k, v and the
    saved log-sum-exp); it keeps K and V unrepeated (2 e kv) and its output in fp32 (4 h) beside the copy the
    output projection takes. Ulysses runs fused attention over the whole sequence for a / c heads, whose output
    the inverse all-to-all copies (e h more); unfused, its scores are a s^2 b / c."""
    b, h, e = micro_batch, model.d_model, act_bytes
    s = seq_len / cp                      # this rank's tokens of each sequence
    sp = tp if sequence_parallel else 1
    if recompute is Recompute.FULL:
        return e * s * b * h / sp
    mask = 1 if model.dropout else 0
    f = model.d_ff
    assert f is not None
    norms = 2 * (e + (FP32_BYTES if model.norm == "rmsnorm" else 0))
    replicated = s * b * h * (norms + e + e + 2 * mask)
    moe = 0.0
    if model.moe_experts:
        # an MoE block: each token's k expert rows run an expert MLP of moe_d_ff, the shared experts one of
        # their summed width; the experts keep their input rows [s b k, h] and the combine their output rows (to
        # weight them), and the router its fp32 logits and scores [s b, E]
        assert model.moe_d_ff is not None
        f = (model.moe_top_k + model.moe_shared_experts) * model.moe_d_ff
        moe = s * b * (2 * e * model.moe_top_k * h + 2 * FP32_BYTES * model.moe_experts)
    mlp = (4 if model.mlp == "swiglu" else 2) * e * s * b * f + moe
    ring = cp > 1 and ContextParallelImpl(cp_impl) is ContextParallelImpl.RING      # the enum or its value
    kv = model.kv_dim if ring else h
    split = s * b * (e * h + 2 * e * kv + e * h) + mlp
    if ring:
        split += s * b * FP32_BYTES * (h + model.n_head)
    elif flash_attention or recompute is Recompute.SELECTIVE:
        split += s * b * FP32_BYTES * model.n_head if flash_attention else 0.0
        split += s * b * e * h if cp > 1 else 0.0      # Ulysses: the all-to-all's copy of the output
    else:
        # a / c heads over the whole sequence, s * c tokens (c = 1 without cp)
        split += model.n_head / cp * (s * cp) ** 2 * b * (e + (mask + e if model.dropout else 0))
        split += s * b * e * h if cp > 1 else 0.0
    tables = 2 * FP32_BYTES * s * model.head_dim if model.positions == "rotary" else 0.0
    return replicated / sp + split / tp + tables


def peak_in_flight(*, stage: int, stages: int, microbatches: int,
                   schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B) -> int:
    """Micro-batches whose activations stage `stage` holds at once: m under GPipe; min(p - stage, m)
    under 1F1B (its warm-up forwards plus one, Megatron's get_pp_rank_microbatches)."""
    if microbatches < 1 or not 0 <= stage < stages:
        raise PlannerError(f"pipeline stage {stage} of {stages} with {microbatches} micro-batch(es): needs "
                           f"0 <= stage < stages and at least one micro-batch")
    if schedule is PipelineSchedule.GPIPE:
        return microbatches
    return min(stages - stage, microbatches)


def in_flight_microbatches(*, pp: int, num_microbatches: int,
                           schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
                           virtual_stages: int = 1) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak: all m for GPipe,
    min(p, m) for 1F1B, times (1 + (p - 1) / (p v)) interleaved (Korthikanti et al. 2022, sec. 4.2.3)."""
    p, m = pp, num_microbatches
    if p == 1:
        return 1.0           # gradient accumulation: each micro-batch's backward frees it before the next
    if schedule is PipelineSchedule.GPIPE:
        return float(m)
    held = float(min(p, m))
    if schedule is PipelineSchedule.INTERLEAVED_1F1B:
        held *= 1 + (p - 1) / (p * virtual_stages)
    return held


@dataclass(frozen=True)
class Activations:
    """Activation bytes of the most loaded pipeline stage."""

    per_layer: float        # one layer, one micro-batch
    layers: int             # layers on that stage
    in_flight: float        # micro-batches held at the peak
    recompute_working: float  # full recompute: one layer rebuilt with all its activations during backward
    embeddings_and_logits: float

    @property
    def total(self) -> float:
        return self.per_layer * self.layers * self.in_flight + self.recompute_working + self.embeddings_and_logits


def activation_bytes(model: GPTConfig, job: JobSpec, plan: Plan) -> Activations:
    """The larger of the first stage (most micro-batches in flight, embeddings) and the last (the loss's fp32
    log-probabilities, 4 s b V / t bytes)."""
    return _activation_bytes(model, job, plan.tp, plan.pp, plan.sequence_parallel, plan.micro_batch,
                             plan.recompute, plan.schedule, plan.virtual_stages, plan.grad_accum(job), plan.cp,
                             plan.cp_impl)


@functools.cache   # the search asks again for every ZeRO stage and offload choice
def _activation_bytes(model: GPTConfig, job: JobSpec, tp: int, pp: int, sequence_parallel: bool, micro_batch: int,
                      recompute: Recompute, schedule: PipelineSchedule, virtual_stages: int, m: int, cp: int = 1,
                      cp_impl: ContextParallelImpl = ContextParallelImpl.RING) -> Activations:
    # Under context parallelism everything outside attention's scores is per token: s / cp of them per rank.
    s, b, e = job.sequence_length(model) / cp, micro_batch, job.precision.nbytes
    layer = functools.partial(layer_activation_bytes, model, micro_batch=b, seq_len=job.sequence_length(model),
                              tp=tp, sequence_parallel=sequence_parallel, act_bytes=e,
                              flash_attention=job.flash_attention, cp=cp, cp_impl=cp_impl)
    per_layer = layer(recompute=recompute)
    working = layer() if recompute is Recompute.FULL else 0.0
    sp = tp if sequence_parallel else 1
    embedding = s * b * model.d_model * (e + (1 if model.dropout else 0)) / sp
    # The lm-head saves its input [s, b, h] (the final norm's output); the loss computes in fp32 and saves its
    # log-probabilities [s, b, V/t] in fp32. The compute-dtype logits themselves are saved by nothing (the
    # matmul keeps its input, the cast to fp32 keeps nothing), so they do not count.
    logits = s * b * (e * model.d_model / sp + FP32_BYTES * model.vocab_size / tp)
    layers = stage_layers(model.n_layer, pp)
    in_flight = in_flight_microbatches(pp=pp, num_microbatches=m, schedule=schedule, virtual_stages=virtual_stages)
    first = Activations(per_layer, layers[0], in_flight, working, embedding + (logits if pp == 1 else 0.0))
    if pp == 1:
        return first
    last_in_flight = float(m) if schedule is PipelineSchedule.GPIPE else 1.0
    last = Activations(per_layer, layers[-1], last_in_flight, working, logits)
    return max(first, last, key=lambda a: a.total)


# -- everything on one GPU -------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU (and in host memory for it) under a plan."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    reserved: float
    cpu: float
    capacity: float          # the GPU's memory
    host_budget: float       # host memory per GPU (its node's, shared by the node's GPUs)

    @property
    def model_states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers + self.reserved

    @property
    def over_budget(self) -> float:
        """Bytes above the GPU's memory (> 0: does not fit)."""
        return self.total - self.capacity

    @property
    def fits(self) -> bool:
        return self.over_budget <= 0 and self.cpu <= self.host_budget


def comm_buffer_bytes(model: GPTConfig, job: JobSpec, plan: Plan, params_on_rank: int) -> float:
    """Communication buffers: ZeRO-1/2's gradient reduce bucket; ZeRO-3's gathered parameters in the compute
    dtype (zero3.py: two blocks in our engine, DeepSpeed's modules and prefetch bucket); pipeline buffers."""
    e = job.precision.nbytes
    buffers = 0.0
    if plan.zero_stage in (1, 2):
        buffers += min(params_on_rank, REDUCE_BUCKET_ELEMENTS) * e
    if plan.zero_stage == 3:
        buffers += zero3_buffer_elements(model, job, plan) * e
    if plan.pp > 1:
        sp = plan.tp if plan.sequence_parallel else 1
        buffers += 2 * plan.micro_batch * job.sequence_length(model) / plan.cp * model.d_model * e / sp
    if plan.cp > 1:
        buffers += context_parallel_buffer_bytes(model, job, plan)
    if plan.ep > 1 and model.moe_experts:
        buffers += expert_parallel_buffer_bytes(model, job, plan)
    return buffers


def expert_parallel_buffer_bytes(model: GPTConfig, job: JobSpec, plan: Plan) -> float:
    """Transient buffers of one MoE layer's all-to-all on one rank: the k rows of each local token sorted by
    expert to send, and as many received, 2 x [b s k, h] in the compute dtype (on average: routing is uneven)."""
    tokens = plan.micro_batch * job.sequence_length(model) / plan.cp
    return 2 * tokens * model.moe_top_k * model.d_model * job.precision.nbytes


def context_parallel_buffer_bytes(model: GPTConfig, job: JobSpec, plan: Plan) -> float:
    """Transient buffers of one layer's cp attention on one rank (s = S / c local tokens, t = tp): ring attention
    holds the key/value block it attends to and the one arriving, 2 x [2, b, kv/t, s] in the compute dtype, and in
    backward the travelling fp32 dk, dv partial sums, 2 x [2, b, kv/t, s] (sent and received); Ulysses holds the
    all-to-all's send and receive buffers of q, k, v (kv heads repeated to c when fewer), 2 x b s (h + 2 kv') / t."""
    s, b, e, t = job.sequence_length(model) / plan.cp, plan.micro_batch, job.precision.nbytes, plan.tp
    if plan.cp_impl is ContextParallelImpl.RING:
        block = 2 * b * s * model.kv_dim / t
        return 2 * block * e + 2 * block * FP32_BYTES
    return 2 * b * s * (model.d_model + 2 * ulysses_kv_width(model, plan.cp)) / t * e


def ulysses_kv_width(model: GPTConfig, cp: int) -> int:
    """Key/value width Ulysses moves: kv heads repeated up to cp when there are fewer of them than cp ranks."""
    assert model.n_kv_head is not None
    return model.kv_dim * (cp // model.n_kv_head if model.n_kv_head < cp else 1)


def memory_per_rank(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> MemoryBreakdown:
    """Model states of the most loaded rank (`plan_model_states`), its activations and buffers."""
    params = sum(busiest_rank_params(model, tp=plan.tp, pp=plan.pp, ep=plan.ep))
    states = plan_model_states(model, job, plan)
    return MemoryBreakdown(
        weights=states.weights, grads=states.grads, optimizer=states.optimizer,
        activations=activation_bytes(model, job, plan).total,
        buffers=comm_buffer_bytes(model, job, plan, params),
        reserved=cluster.reserved_memory_bytes, cpu=states.cpu,
        capacity=cluster.memory_bytes,
        host_budget=cluster.host_memory_bytes / cluster.gpus_per_node,
    )
