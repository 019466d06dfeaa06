"""Seconds of one transformer block and of the model's head on one rank, from the shapes of their kernels: each
GEMM at the large-GEMM ceiling plus its operand traffic (`gemm_seconds`), the memory-bound kernels around the
matmuls at their per-element costs (`ElementCosts`), and the operators' fixed cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.config.schema import ContextParallelImpl
from shardwise.models.presets import GPTConfig
from shardwise.planner.specs import ClusterSpec, JobSpec, Plan, Recompute

NORM_BYTES, ACTIVATION_BYTES = 5, 5       # x e, forward + backward
RESIDUAL_BYTES, SCORE_BYTES = (5, 2), (9, 2)   # x e, + mask bytes


def gemm_seconds(m: float, k: float, n: float, cluster: ClusterSpec, job: JobSpec, *, count: float = 1) -> float:
    """`count` GEMMs [m, k] x [k, n]. A GEMM [M, K] x [K, N] does 2 M K N FLOPs but also streams its operands
    and result, e (M K + K N + M N) bytes, so its time is taken as the sum

        t = 2 M K N / (peak * compute_efficiency) + e (M K + K N + M N) / gemm_operand_bw

    Small and thin GEMMs (small hidden size, few tokens per micro-batch, a TP split that narrows N or K) run
    further below the ceiling than large ones; the efficiency rises with the GEMM towards compute_efficiency.
    The forward, input-gradient and weight-gradient GEMMs of a linear layer touch the same three matrices, so
    training costs three of them (four under full recomputation)."""
    rate = cluster.peak_flops(job.precision) * cluster.compute_efficiency
    t = 2.0 * m * k * n / rate
    if cluster.gemm_operand_bw > 0:
        t += job.precision.nbytes * (m * k + k * n + m * n) / cluster.gemm_operand_bw
    return count * t


@dataclass(frozen=True)
class ElementCosts:
    """Seconds per element, forward + backward, of the memory-bound kernels around the matmuls. Relative to the
    matmuls they shrink as 1/h (per-token work: norms, bias + dropout + residual, GELU) and as a s / h^2
    (attention scores: scale + mask + softmax and dropout over a s^2 elements a sequence), which is why achieved
    FLOP/s grow with the model in published weak-scaling tables.

    What `--calibrate` measured (activation_s, norm_s, the attention rate), or, on a datasheet cluster that
    measured none of them, the bytes each kernel moves over memory_bw, e the element size: norm and
    nonlinearity 5 e (forward reads and writes, backward reads input and gradient, writes the gradient),
    bias + dropout + residual 5 e + 2 (the 1-byte mask written, then read), score 9 e + 2 (fused softmax 5 e,
    dropout 4 e + 2).
    """

    norm_s: float
    activation_s: float
    residual_s: float
    score_s: float

    @classmethod
    def of(cls, cluster: ClusterSpec, job: JobSpec) -> "ElementCosts":
        if cluster.attention_flops > 0 or cluster.activation_s > 0 or cluster.norm_s > 0:
            # measured: the attention probe includes its softmax; residual adds were not measured apart
            return cls(cluster.norm_s, cluster.activation_s, 0.0, 0.0)
        e, bw = job.precision.nbytes, cluster.memory_bw
        return cls(NORM_BYTES * e / bw, ACTIVATION_BYTES * e / bw, (RESIDUAL_BYTES[0] * e + RESIDUAL_BYTES[1]) / bw,
                   (SCORE_BYTES[0] * e + SCORE_BYTES[1]) / bw)


@dataclass(frozen=True)
class Parts:
    """Seconds of forward + backward (+ recomputation) on one rank, by kind of work."""

    matmul_s: float = 0.0
    attention_s: float = 0.0
    pointwise_s: float = 0.0
    operators_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.attention_s + self.pointwise_s + self.operators_s

    def __add__(self, other: "Parts") -> "Parts":
        return Parts(self.matmul_s + other.matmul_s, self.attention_s + other.attention_s,
                     self.pointwise_s + other.pointwise_s, self.operators_s + other.operators_s)

    def __mul__(self, k: float) -> "Parts":
        return Parts(self.matmul_s * k, self.attention_s * k, self.pointwise_s * k, self.operators_s * k)


def _passes(recompute: Recompute) -> tuple[int, int]:
    """GEMM passes of (the block's linear layers, its attention core): forward, input and weight gradients
    (the attention core has no weights but two inputs), plus a forward recomputed."""
    return (4 if recompute is Recompute.FULL else 3,
            3 if recompute is Recompute.NONE else 4)


def _attention(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan, passes: int) -> float:
    """The attention core of one rank. Under context parallelism over c ranks each does 1/c of the score work:
    ring attention c blocks of [S/c, S/c] scores, Ulysses a / c heads of [S, S] (the causal ring skips the
    blocks above the diagonal as a causal kernel skips tiles; counted like the papers, every score)."""
    b, s, t, c = plan.micro_batch, job.sequence_length(model), plan.tp, plan.cp
    d, heads = model.head_dim, model.n_head / t
    flops = 4.0 * b * s * s * model.d_model / t / c        # QK^T and AV, every score (papers' count)
    if cluster.attention_flops > 0:   # measured with a causal kernel, counted without the mask, in fp32
        same_share = cluster.peak_flops(job.precision) / cluster.peak_flops_fp32
        return passes * flops / (cluster.attention_flops * same_share)
    if job.flash_attention:   # one fused kernel: q, k, v in, the output out; a causal one skips masked tiles
        rate = cluster.peak_flops(job.precision) * cluster.compute_efficiency
        io = 4 * b * s / c * model.d_model / t * job.precision.nbytes
        return passes * (0.5 * flops / rate
                         + (io / cluster.gemm_operand_bw if cluster.gemm_operand_bw > 0 else 0.0))
    rows: float = s
    if c > 1 and plan.cp_impl is ContextParallelImpl.RING:     # c blocks of S/c keys for S/c queries
        rows, pairs = s / c, passes * b * heads * c
    else:                                                    # Ulysses: a / c heads over the whole sequence
        pairs = passes * b * heads / c
    return (gemm_seconds(rows, d, rows, cluster, job, count=pairs)
            + gemm_seconds(rows, rows, d, cluster, job, count=pairs))


def block_parts(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan, *, moe: bool = False) -> Parts:
    """One transformer block, one micro-batch of b sequences of s tokens, one TP rank of t (h hidden,
    f = d_ff, a heads):

        linear layers   M = b s;  QKV K = h, N = (h + 2 kv) / t;  output K = h / t, N = h;
                        MLP in K = h, N = f / t (x2 SwiGLU);  MLP out K = f / t, N = h
        attention core  b a / t pairs of [s, d] x [d, s] and [s, s] x [s, d] (d = h / a), every score
                        computed; with flash attention one fused causal kernel at the ceiling (half the
                        scores) that streams q, k, v and the output only
        pointwise       b s per-token elements: 2 norms of h and 2 bias+dropout+residual of h (split over t
                        only with sequence parallelism), the MLP nonlinearity over f / t; scores a s^2 b / t
                        (not with flash attention)

    An MoE block (`moe`) runs in place of the MLP a router GEMM (K = h, N = E), and on each rank its E / ep
    experts, each a GEMM of the b s k ep / E rows it receives on average (routing spread evenly: b s k rows in
    all, whatever ep), with K, N those of an MLP of width moe_d_ff split over t; the shared experts as one MLP of
    their summed width; the nonlinearity over (k + shared) moe_d_ff / t per token.

    Recomputation repeats the forward: full recomputation every forward kernel (the pointwise costs x 1.5),
    selective the attention core and its scores."""
    assert model.d_ff is not None
    b, s, t, h, f = plan.micro_batch, job.sequence_length(model), plan.tp, model.d_model, model.d_ff
    tokens = b * s / plan.cp        # context parallelism: this rank's share of each sequence
    linear_passes, attention_passes = _passes(plan.recompute)
    mlp_in = 2 if model.mlp == "swiglu" else 1
    shapes = [(h, (h + 2 * model.kv_dim) / t), (h / t, h)]         # QKV, attention output
    if not moe:
        shapes += [(h, mlp_in * f / t), (f / t, h)]                 # MLP in (and gate), MLP out
    matmul = sum(gemm_seconds(tokens, k, n, cluster, job, count=linear_passes) for k, n in shapes)
    if moe:
        w, experts, top_k = model.moe_d_ff, model.moe_experts, model.moe_top_k
        assert w is not None
        local = experts // plan.ep
        rows = tokens * top_k * plan.ep / experts       # rows each local expert receives
        matmul += gemm_seconds(tokens, h, experts, cluster, job, count=linear_passes)
        matmul += sum(gemm_seconds(rows, k, n, cluster, job, count=linear_passes * local)
                      for k, n in ((h, mlp_in * w / t), (w / t, h)))
        if model.moe_shared_experts:
            shared = model.moe_shared_experts * w
            matmul += sum(gemm_seconds(tokens, k, n, cluster, job, count=linear_passes)
                          for k, n in ((h, mlp_in * shared / t), (shared / t, h)))
        f = (top_k + model.moe_shared_experts) * w
    attention = _attention(model, cluster, job, plan, attention_passes)
    c = ElementCosts.of(cluster, job)
    sp = t if plan.sequence_parallel else 1
    per_token = 2 * h / sp * (c.norm_s + c.residual_s) + f / t * c.activation_s
    pointwise = tokens * per_token
    scores = 0.0 if job.flash_attention else model.n_head / t * s * s * b / plan.cp * c.score_s
    if plan.recompute is Recompute.FULL:    # the forward (about half of these) runs once more in backward
        pointwise, scores = 1.5 * pointwise, 1.5 * scores
        operators = 1.5 * cluster.layer_overhead_s
    else:
        operators = cluster.layer_overhead_s
        if plan.recompute is Recompute.SELECTIVE:
            scores *= 1.5
    return Parts(matmul, attention, pointwise + scores, operators)


def head_parts(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> Parts:
    """The last stage's extra work per micro-batch: the logits GEMM (three passes; recomputation keeps the
    head), the final norm and the loss's softmax over V / t, and the rest of a micro-batch's operators."""
    tokens = plan.micro_batch * job.sequence_length(model) / plan.cp
    c = ElementCosts.of(cluster, job)
    logits = gemm_seconds(tokens, model.d_model, model.vocab_size / plan.tp, cluster, job, count=3)
    pointwise = tokens * (model.d_model + model.vocab_size / plan.tp) * c.norm_s
    operators = cluster.microbatch_overhead_s * (1.5 if plan.recompute is Recompute.FULL else 1.0)
    return Parts(logits, 0.0, pointwise, operators)


def embedding_parts(model: GPTConfig, cluster: ClusterSpec, job: JobSpec, plan: Plan) -> Parts:
    """The first stage's extra work per micro-batch: the embedding lookup (+ positions) and its dropout, a
    bias + dropout + residual's worth of traffic over b s h elements."""
    tokens = plan.micro_batch * job.sequence_length(model) / plan.cp
    sp = plan.tp if plan.sequence_parallel else 1
    return Parts(pointwise_s=tokens * model.d_model / sp * ElementCosts.of(cluster, job).residual_s)
