"""Communication per training step: which collectives each parallel axis runs, how many bytes (`Collective`:
payload and ring bytes sent), how long (`ring_seconds`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from shardwise.config import PipelineSchedule
from shardwise.config.schema import ContextParallelImpl
from shardwise.models.presets import GPTConfig
from shardwise.planner.flops import busiest_rank_params, moe_blocks_per_stage, stage_layers
from shardwise.planner.memory import FP32_BYTES, gradient_buckets, ulysses_kv_width
from shardwise.planner.specs import ClusterSpec, JobSpec, Plan, Recompute
from shardwise.planner.zero3 import units_per_block


class Op(str, enum.Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    SEND = "send"


class Axis(str, enum.Enum):
    DP = "dp"
    TP = "tp"
    PP = "pp"
    CP = "cp"
    EP = "ep"


class Link(str, enum.Enum):
    INTRA_NODE = "intra-node"
    INTER_NODE = "inter-node"


def ring_send_bytes(op: Op, payload_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring implementation of `op` over `group_size` ranks: all-reduce
    2 (p - 1) / p * payload; reduce-scatter, all-gather and all-to-all (p - 1) / p * payload each; a
    point-to-point send the payload itself. The ZeRO paper's "2 psi" for DP (3 psi for ZeRO-3) is this volume in
    elements for large p.
    The payload is the full tensor of one collective, what `CommLedger` records (an all-reduce's tensor, a
    reduce-scatter's input, an all-gather's output): data parallelism all-reduces psi * bytes per gradient."""
    p = group_size
    if op is Op.SEND:
        return payload_bytes
    if p == 1:
        return 0.0
    steps = 2 * (p - 1) if op is Op.ALL_REDUCE else p - 1
    return steps * payload_bytes / p


def ring_seconds(op: Op, payload_bytes: float, group_size: int, *, bandwidth: float, latency_s: float,
                 messages: int = 1) -> float:
    """Alpha-beta time of `op` (Thakur et al. 2005): all-reduce 2 (p - 1) alpha + 2 (p - 1) / p * n / B,
    reduce-scatter and all-gather (p - 1) alpha + (p - 1) / p * n / B, send alpha + n / B; the reduction
    arithmetic itself is not timed. `messages` separate collectives (buckets, layers) share the payload, each
    paying the latency of its ring steps. `_timed` takes B and alpha of the slowest link the group crosses
    (NVLink inside a node, the network between nodes), or those a calibration measured for reduce-scatter and
    all-gather themselves (gloo's differ from its all-reduce's)."""
    p = group_size
    if op is not Op.SEND and p == 1:
        return 0.0
    hops = 1 if op is Op.SEND else (2 * (p - 1) if op is Op.ALL_REDUCE else p - 1)
    return messages * hops * latency_s + ring_send_bytes(op, payload_bytes, p) / bandwidth


@dataclass(frozen=True)
class Collective:
    """One kind of collective a rank runs during a step."""

    axis: Axis
    op: Op
    purpose: str
    group_size: int
    payload_bytes: float     # per call, ledger convention (the full tensor)
    calls: int               # per step
    link: Link
    seconds: float           # per call
    messages: int = 1        # separate collectives per call that share the payload (buckets, layers)

    @property
    def total_payload_bytes(self) -> float:
        return self.payload_bytes * self.calls

    @property
    def sent_bytes(self) -> float:
        """Ring wire volume of this rank over the step."""
        return ring_send_bytes(self.op, self.payload_bytes, self.group_size) * self.calls

    @property
    def total_seconds(self) -> float:
        return self.seconds * self.calls


def zero_paper_volume(num_params: float, zero_stage: int) -> float:
    """Rajbhandari et al. section 7, elements per rank per step: 2 psi for DP and ZeRO-1/2 (reduce-scatter
    + all-gather), 3 psi for ZeRO-3 (all-gather in forward and in backward + reduce-scatter)."""
    return (3 if zero_stage == 3 else 2) * num_params


def _aligned_within_node(block: int, cluster: ClusterSpec) -> bool:
    """Groups made of `block` consecutive ranks never straddle a node boundary."""
    return block <= cluster.gpus_per_node and cluster.gpus_per_node % block == 0


def link_of(axis: Axis, cluster: ClusterSpec, plan: Plan) -> Link:
    """Whether every group of `axis` stays inside one node. Ranks are laid out (pp, dp, cp, tp) with tp
    innermost, so a TP group spans tp ranks, a CP group cp * tp, the gradient group (dp x cp, the parameters'
    replicas) dp * cp * tp, a pipeline pp * dp * cp * tp."""
    size = {Axis.TP: plan.tp, Axis.CP: plan.cp, Axis.DP: plan.replicas, Axis.PP: plan.pp, Axis.EP: plan.ep}[axis]
    block = {Axis.TP: plan.tp, Axis.CP: plan.cp * plan.tp, Axis.DP: plan.replicas * plan.tp,
             Axis.PP: plan.world_size, Axis.EP: plan.ep * plan.cp * plan.tp}[axis]
    return Link.INTRA_NODE if size == 1 or _aligned_within_node(block, cluster) else Link.INTER_NODE


def _timed(axis: Axis, op: Op, purpose: str, size: int, payload: float, calls: int, cluster: ClusterSpec,
           plan: Plan, messages: int = 1, efficiency: float = 1.0) -> Collective:
    """`efficiency`: the share of the link's bandwidth this kind of collective achieves."""
    link = link_of(axis, cluster, plan)
    bw, alpha = ((cluster.intra_node_bw, cluster.intra_node_latency_s) if link is Link.INTRA_NODE
                 else (cluster.inter_node_bw, cluster.inter_node_latency_s))
    if link is Link.INTER_NODE and size > 1:
        # a ring through k nodes crosses the network k - 1 times a round, NVLink for the other hops
        stride = {Axis.TP: 1, Axis.CP: plan.tp, Axis.DP: plan.tp, Axis.PP: plan.tp * plan.replicas,
                  Axis.EP: plan.tp * plan.cp}[axis]
        nodes = min(size, math.ceil(size / max(1, cluster.gpus_per_node // stride)))
        alpha = ((nodes - 1) * alpha + (size - nodes) * cluster.intra_node_latency_s) / (size - 1)
    measured = {Op.REDUCE_SCATTER: (cluster.reduce_scatter_bw, cluster.reduce_scatter_latency_s),
                Op.ALL_GATHER: (cluster.all_gather_bw, cluster.all_gather_latency_s)}.get(op, (0.0, 0.0))
    if measured[0] > 0:   # a calibration timed this collective itself (one host: one kind of link)
        bw, alpha = measured
    bw *= efficiency
    seconds = ring_seconds(op, payload, size, bandwidth=bw, latency_s=alpha, messages=messages)
    return Collective(axis, op, purpose, size, payload, calls, link, seconds, messages)


def dp_collectives(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> list[Collective]:
    """Gradient and parameter traffic over the data-parallel group (dp x cp: context-parallel ranks hold the same
    parameters, so their gradients are reduced and ZeRO shards over them too), per step. Stage 0: one all-reduce of
    the gradients (in buckets). ZeRO-1: reduce-scatter at the step + all-gather of the updated params.
    ZeRO-2: the gradient shards are reduce-scattered on every micro-batch's backward (partitioned
    gradients cannot accumulate unreduced). ZeRO-3: parameters are gathered for every forward and every
    backward of every micro-batch, gradients reduce-scattered each backward.

    Under expert parallelism a rank's experts have collectives of their own, the same ones over the
    expert-data-parallel group (`Plan.expert_replicas` ranks; "experts: ..." purposes)."""
    dense, experts = busiest_rank_params(model, tp=plan.tp, pp=plan.pp, ep=plan.ep)
    if plan.ep == 1:
        return _replica_collectives(model, cluster, job, plan, dense + experts, plan.replicas, "")
    return (_replica_collectives(model, cluster, job, plan, dense, plan.replicas, "")
            + _replica_collectives(model, cluster, job, plan, experts, plan.expert_replicas, "experts: "))


def _replica_collectives(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan, psi: int, replicas: int,
                         prefix: str) -> list[Collective]:
    """`dp_collectives` of `psi` parameters held alike by `replicas` ranks."""
    if replicas == 1 or psi == 0:
        return []
    if plan.zero_stage >= 1:   # ZeRO pads the flat buffer to whole shards: dp * ceil(psi / dp) elements
        psi = replicas * math.ceil(psi / replicas)
    n = psi * job.precision.nbytes
    m = plan.grad_accum(job)
    buckets = gradient_buckets(psi, job, plan)
    layers = stage_layers(model.n_layer, plan.pp)[0]
    args = (replicas, n)
    if plan.zero_stage == 0:
        return [_timed(Axis.DP, Op.ALL_REDUCE, prefix + "gradients", *args, 1, cluster, plan, buckets)]
    if plan.zero_stage in (1, 2):
        rs_calls = 1 if plan.zero_stage == 1 else m
        return [_timed(Axis.DP, Op.REDUCE_SCATTER, prefix + "gradients", *args, rs_calls, cluster, plan, buckets),
                _timed(Axis.DP, Op.ALL_GATHER, prefix + "updated parameters", *args, 1, cluster, plan, buckets)]
    # one collective per gathered unit: a block (our engine) or each module of it (DeepSpeed), at the share of
    # the link that ZeRO-3's many uneven collectives achieve
    units, eff = layers * units_per_block(model, job), cluster.gather_efficiency
    return [_timed(Axis.DP, Op.ALL_GATHER, prefix + "parameters (forward, backward)", *args, 2 * m, cluster, plan,
                   units, eff),
            _timed(Axis.DP, Op.REDUCE_SCATTER, prefix + "gradients", *args, m, cluster, plan, units, eff)]


def tp_collectives(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> list[Collective]:
    """Megatron TP: per layer and micro-batch, 2 all-reduces of b s h in forward and 2 in backward, 2 more
    for the recomputed forward under full recomputation. Sequence parallelism turns each into a
    reduce-scatter + an all-gather of the same volume."""
    if plan.tp == 1:
        return []
    payload = plan.micro_batch * job.sequence_length(model) / plan.cp * model.d_model * job.precision.nbytes
    per_layer = 6 if plan.recompute is Recompute.FULL else 4
    calls = per_layer * stage_layers(model.n_layer, plan.pp)[0] * plan.grad_accum(job)
    if not plan.sequence_parallel:
        return [_timed(Axis.TP, Op.ALL_REDUCE, "layer activations", plan.tp, payload, calls, cluster, plan)]
    return [_timed(Axis.TP, Op.REDUCE_SCATTER, "layer activations (SP)", plan.tp, payload, calls, cluster, plan),
            _timed(Axis.TP, Op.ALL_GATHER, "layer activations (SP)", plan.tp, payload, calls, cluster, plan)]


def pp_collectives(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> list[Collective]:
    """Pipeline: per micro-batch a middle stage sends b s h activations forward and their gradient
    backward (each v times interleaved). Only b s h / t crosses with sequence parallelism (the activation is
    already split) or Megatron's scatter/gather (Narayanan et al. 2021 sec. 4.1: each TP rank sends its 1/t
    slice, the receiving stage all-gathers the whole over NVLink, which is charged here too)."""
    if plan.pp == 1:
        return []
    full = plan.micro_batch * job.sequence_length(model) / plan.cp * model.d_model * job.precision.nbytes
    split = plan.tp if plan.sequence_parallel or job.pp_scatter_gather else 1
    v = plan.virtual_stages if plan.schedule is PipelineSchedule.INTERLEAVED_1F1B else 1
    calls = 2 * v * plan.grad_accum(job)
    out = [_timed(Axis.PP, Op.SEND, "stage boundary activations + grads", 2, full / split, calls, cluster, plan)]
    if job.pp_scatter_gather and not plan.sequence_parallel and plan.tp > 1:
        out.append(_timed(Axis.TP, Op.ALL_GATHER, "pipeline scatter/gather", plan.tp, full, calls, cluster, plan))
    return out


def cp_collectives(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> list[Collective]:
    """Context parallelism, per layer and micro-batch on one rank of c, s = S / c local tokens, kv = key/value
    width, t = tp, e = the compute dtype's bytes:

    - ring: a forward pass sends c - 1 key/value blocks [2, b, kv/t, s] (e bytes) to the next rank; backward
      passes them round again (c - 1 sends) and the block's fp32 dk, dv partial sums travel with them, c sends
      (the last brings them home). A recomputed forward (selective or full) runs the ring again.
    - Ulysses: each pass runs four all-to-alls, q, k, v to whole heads and the output back (the gradients the
      other way in backward), b s (2 h + 2 kv') / t e bytes in all, kv' repeated up to c heads when fewer.

    How much of this hides behind the attention is time.py's (`cp_exposed_seconds`)."""
    if plan.cp == 1:
        return []
    c, b, t, e = plan.cp, plan.micro_batch, plan.tp, job.precision.nbytes
    s = job.sequence_length(model) / c
    layers, m = stage_layers(model.n_layer, plan.pp)[0], plan.grad_accum(job)
    forwards = 1 if plan.recompute is Recompute.NONE else 2
    if plan.cp_impl is ContextParallelImpl.RING:
        block = 2 * b * s * model.kv_dim / t
        sends = (forwards + 1) * (c - 1) * layers * m
        return [_timed(Axis.CP, Op.SEND, "ring keys and values", c, block * e, sends, cluster, plan),
                _timed(Axis.CP, Op.SEND, "ring key/value gradients (fp32)", c, block * FP32_BYTES,
                       c * layers * m, cluster, plan)]
    payload = b * s * (2 * model.d_model + 2 * ulysses_kv_width(model, c)) / t * e
    return [_timed(Axis.CP, Op.ALL_TO_ALL, "Ulysses q, k, v and output", c, payload,
                   (forwards + 1) * layers * m, cluster, plan, messages=4)]


def expert_all_to_all_bytes(model: GPTConfig, *, tokens: float, ep: int, nbytes: int) -> float:
    """Bytes one rank sends to other ranks in one MoE layer's dispatch (and again in its combine) of `tokens`
    local tokens: each token's k rows of d_model elements, of which (ep - 1) / ep go to experts on other ranks
    (routing spread evenly). The ledger records each all-to-all's whole input, tokens k h e; this is the share
    that leaves the rank (`ring_send_bytes` of an ALL_TO_ALL)."""
    return tokens * model.moe_top_k * model.d_model * nbytes * (ep - 1) / ep


def ep_collectives(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> list[Collective]:
    """Expert parallelism, per MoE block and micro-batch on one rank: its tokens = b s / cp (/ tp with sequence
    parallelism, each TP rank dispatching its share) go to their k experts' ranks (dispatch) and the expert
    outputs come back (combine), each an all-to-all of tokens k h e bytes of input; backward runs both again with
    the gradients, and a recomputed forward both once more. Time: all exposed (time.py), since the experts need
    what the dispatch brings and the next layer what the combine returns."""
    if plan.ep == 1 or not model.moe_experts:
        return []
    sp = plan.tp if plan.sequence_parallel else 1
    tokens = plan.micro_batch * job.sequence_length(model) / plan.cp / sp
    payload = tokens * model.moe_top_k * model.d_model * job.precision.nbytes
    passes = 2 if plan.recompute is Recompute.NONE else 3      # forward, backward (+ the recomputed forward)
    calls = 2 * passes * moe_blocks_per_stage(model, plan.pp)[0] * plan.grad_accum(job)
    return [_timed(Axis.EP, Op.ALL_TO_ALL, "MoE dispatch and combine", plan.ep, payload, calls, cluster, plan)]


def step_collectives(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> list[Collective]:
    return (dp_collectives(model, cluster, job, plan) + tp_collectives(model, cluster, job, plan)
            + pp_collectives(model, cluster, job, plan) + cp_collectives(model, cluster, job, plan)
            + ep_collectives(model, cluster, job, plan))
