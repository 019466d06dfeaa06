"""Parameter counts and training FLOPs: forward = 2 FLOPs per weight per token (a multiply and an add), backward
= 2 x forward, full activation recomputation runs the forward once more; norms, biases and softmax are not
counted (papers' lower bound). Attention scores by either convention (`forward_flops`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardwise.models.presets import GPTConfig
from shardwise.planner.specs import Recompute

SECONDS_PER_DAY = 86_400.0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- parameters ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer block, split by how tensor parallelism treats them."""

    matmul: int
    """Weights of the linear layers (q, k, v, o and the MLP): split over TP, and what a token multiplies."""
    column_bias: int
    """Biases of the column-parallel layers (q, k, v, MLP input): split over TP."""
    replicated: int
    """Biases of the row-parallel layers (o, MLP output) and the norms: a full copy on every TP rank."""

    @property
    def total(self) -> int:
        return self.matmul + self.column_bias + self.replicated

    def per_tp_rank(self, tp: int) -> int:
        return _ceil_div(self.matmul, tp) + _ceil_div(self.column_bias, tp) + self.replicated


def norm_params(model: GPTConfig) -> int:
    """One norm layer: a weight, plus a bias for a LayerNorm in a model with biases."""
    return model.d_model * (2 if model.norm == "layernorm" and model.bias else 1)


@functools.cache
def layer_params(model: GPTConfig) -> LayerParams:
    d, f, kv, b = model.d_model, model.d_ff, model.kv_dim, int(model.bias)
    assert f is not None
    mlp_in = 2 if model.mlp == "swiglu" else 1          # SwiGLU: gate and up projections
    matmul = 2 * d * d + 2 * d * kv + (mlp_in + 1) * d * f  # q, o: d x d; k, v: d x kv; MLP
    column_bias = b * (d + 2 * kv + mlp_in * f)
    replicated = b * (d + d) + 2 * norm_params(model)      # o and MLP-output biases, two norms
    return LayerParams(matmul, column_bias, replicated)


def _mlp_params(model: GPTConfig, width: int) -> LayerParams:
    """One MLP of hidden width `width` in the model's kind: its input (and gate) projections column-parallel, its
    output projection row-parallel (the output bias a full copy on every TP rank)."""
    d, b = model.d_model, int(model.bias)
    mlp_in = 2 if model.mlp == "swiglu" else 1
    return LayerParams(matmul=(mlp_in + 1) * d * width, column_bias=b * mlp_in * width, replicated=b * d)


_NO_PARAMS = LayerParams(0, 0, 0)


@dataclass(frozen=True)
class MoEParams:
    """What an MoE block holds in place of the dense MLP `layer_params` counts: a router (d x E, no bias, a full
    copy on every rank), E routed experts of which a token runs k, and the shared experts as one MLP that every
    token runs. Experts are split over TP as the dense MLP is, and over EP by whole experts (E / ep per rank)."""

    layers: int           # blocks with an MoE layer (all but the first `moe_first_dense`)
    experts: int          # E
    top_k: int            # k
    router: int
    expert: LayerParams   # one routed expert
    shared: LayerParams   # the shared experts together (no parameters without them)
    dense_mlp: LayerParams  # the dense MLP an MoE layer replaces
    layers_end: int       # n_layer: the MoE blocks are the last `layers` of them

    def non_expert_delta(self, tp: int = 1) -> int:
        """Per MoE block, on one TP rank: the router and shared experts, less the dense MLP they replace."""
        return self.router + self.shared.per_tp_rank(tp) - self.dense_mlp.per_tp_rank(tp)

    def expert_params(self, tp: int = 1, ep: int = 1) -> int:
        """Per MoE block, on one (TP, EP) rank: its E / ep routed experts."""
        return self.experts // ep * self.expert.per_tp_rank(tp)

    @property
    def total_delta(self) -> int:
        """Per MoE block, every parameter it adds over the dense block."""
        return self.non_expert_delta() + self.expert_params()

    @property
    def active_delta(self) -> int:
        """Per MoE block, what a token runs beyond the dense block: router, k experts, the shared ones."""
        return self.non_expert_delta() + self.top_k * self.expert.total

    @property
    def active_matmul_delta(self) -> int:
        """The weights a token multiplies in an MoE block beyond the dense block's (biases and norms left out)."""
        return self.router + self.top_k * self.expert.matmul + self.shared.matmul - self.dense_mlp.matmul

    def layers_in(self, first: int, count: int) -> int:
        """MoE blocks among blocks first .. first + count - 1."""
        start = max(first, self.layers_start)
        return max(0, first + count - start)

    @property
    def layers_start(self) -> int:
        """Index of the first MoE block (the blocks before it keep the dense MLP)."""
        return self.layers_end - self.layers


@functools.cache
def moe_params(model: GPTConfig) -> MoEParams:
    """The model's MoE layers by part; a dense model has `layers` = 0 and every delta 0."""
    if not model.moe_experts:
        return MoEParams(0, 1, 1, 0, _NO_PARAMS, _NO_PARAMS, _NO_PARAMS, model.n_layer)
    width, f = model.moe_d_ff, model.d_ff
    assert width is not None and f is not None
    layers = sum(model.is_moe_block(i) for i in range(model.n_layer))
    shared = _mlp_params(model, model.moe_shared_experts * width) if model.moe_shared_experts else _NO_PARAMS
    return MoEParams(layers=layers, experts=model.moe_experts, top_k=model.moe_top_k,
                     router=model.d_model * model.moe_experts, expert=_mlp_params(model, width), shared=shared,
                     dense_mlp=_mlp_params(model, f), layers_end=model.n_layer)


@dataclass(frozen=True)
class ParamCount:
    """Every parameter of the model, a tied lm head counted once."""

    layers: int          # all transformer blocks, every expert included
    token_embedding: int
    position_embedding: int
    final_norm: int
    lm_head: int         # 0 when tied to the token embedding
    idle_experts: int = 0
    """Routed experts a token does not run: (E - k) experts of every MoE block."""

    @property
    def total(self) -> int:
        return self.layers + self.token_embedding + self.position_embedding + self.final_norm + self.lm_head

    @property
    def non_embedding(self) -> int:
        """Kaplan et al.'s N: without the token and position tables (an untied head stays in)."""
        return self.total - self.token_embedding - self.position_embedding

    @property
    def active(self) -> int:
        """Parameters one token runs through (an MoE's k routed experts and its shared ones; all of a dense
        model): the published "active parameters"."""
        return self.total - self.idle_experts


@functools.cache
def param_count(model: GPTConfig) -> ParamCount:
    """Exact parameter count; equals `shardwise.models.gpt_num_params` for our GPT."""
    d, moe = model.d_model, moe_params(model)
    return ParamCount(
        layers=model.n_layer * layer_params(model).total + moe.layers * moe.total_delta,
        token_embedding=model.vocab_size * d,
        position_embedding=model.seq_len * d if model.positions == "learned" else 0,
        final_norm=norm_params(model),
        lm_head=0 if model.tie_embeddings else model.vocab_size * d,
        idle_experts=moe.layers * (moe.experts - moe.top_k) * moe.expert.total,
    )


def narayanan_params(*, n_layer: int, d_model: int, vocab_size: int, seq_len: int) -> float:
    """Narayanan et al. 2021 eq. 2 for a GPT (4h MLP, biases, learned positions, tied head):
    P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)). It omits the final LayerNorm (2h)."""
    l, h = n_layer, d_model
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab_size + seq_len) / (12 * l * h))


@functools.cache
def stage_layers(n_layer: int, pp: int) -> tuple[int, ...]:
    """Blocks per pipeline stage, as even as possible, earlier stages taking the remainder."""
    base, extra = divmod(n_layer, pp)
    return tuple(base + (1 if i < extra else 0) for i in range(pp))


@functools.cache
def params_per_stage(model: GPTConfig, *, tp: int, pp: int, ep: int = 1) -> tuple[int, ...]:
    """Parameters held by one TP rank of each pipeline stage, its E / ep experts of each MoE block included
    (`expert_params_per_stage` says how many of them are experts'). The first stage holds the token (and
    position) tables; the last the final norm and the lm head, or with a tied head on pp > 1 a copy of
    the token table (Megatron keeps one there and all-reduces its gradient). Vocabulary-parallel
    tables are split over TP; position tables are replicated."""
    count = param_count(model)
    per_layer = layer_params(model).per_tp_rank(tp)
    moe = moe_params(model)
    vocab_table = _ceil_div(model.vocab_size, tp) * model.d_model
    stages = [n * per_layer + moe_blocks * (moe.non_expert_delta(tp) + moe.expert_params(tp, ep))
              for n, moe_blocks in zip(stage_layers(model.n_layer, pp), moe_blocks_per_stage(model, pp))]
    stages[0] += vocab_table + count.position_embedding
    stages[-1] += count.final_norm
    if not model.tie_embeddings or pp > 1:
        stages[-1] += vocab_table
    return tuple(stages)


@functools.cache
def moe_blocks_per_stage(model: GPTConfig, pp: int) -> tuple[int, ...]:
    """MoE blocks on each pipeline stage (the dense first blocks sit on the first stage)."""
    moe, out, first = moe_params(model), [], 0
    for n in stage_layers(model.n_layer, pp):
        out.append(moe.layers_in(first, n))
        first += n
    return tuple(out)


def expert_params_per_stage(model: GPTConfig, *, tp: int, pp: int, ep: int = 1) -> tuple[int, ...]:
    """Routed-expert parameters one (TP, EP) rank of each stage holds: E / ep experts of each of its MoE blocks.
    They are reduced and ZeRO-sharded over the expert-data-parallel group (the replicas / ep ranks holding the
    same experts), the rest of the stage over all replicas."""
    per_block = moe_params(model).expert_params(tp, ep)
    return tuple(n * per_block for n in moe_blocks_per_stage(model, pp))


def params_per_rank(model: GPTConfig, *, tp: int = 1, pp: int = 1, ep: int = 1) -> int:
    """The most parameters any rank holds (what its memory must fit). tp = pp = ep = 1: the total."""
    return max(params_per_stage(model, tp=tp, pp=pp, ep=ep))


def busiest_rank_params(model: GPTConfig, *, tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(non-expert, expert) parameters of the stage whose rank holds the most: the two are sharded over
    different groups, so memory and traffic need them apart."""
    stages = params_per_stage(model, tp=tp, pp=pp, ep=ep)
    experts = expert_params_per_stage(model, tp=tp, pp=pp, ep=ep)
    i = max(range(len(stages)), key=stages.__getitem__)
    return stages[i] - experts[i], experts[i]


# -- FLOPs -----------------------------------------------------------------------------------------

def six_nd(num_params: float, tokens: float) -> float:
    """Kaplan et al. 2020: training costs 6 FLOPs per parameter per token (2 forward, 4 backward)."""
    return 6.0 * num_params * tokens


def flops_per_token(model: GPTConfig, *, seq_len: int | None = None, causal: bool = True) -> int:
    """Training FLOPs per token without recomputation, counted as our GPT does:
    6 * N + (6 if causal else 12) * n_layer * s * d_model, where N is every parameter a token's matmuls
    touch (blocks, final norm, and the lm head's V * d whether or not tied). With causal=True and
    s = the model's context this equals `shardwise.models.gpt_flops_per_token`. In an MoE block N has the
    active parameters only: the router, k routed experts and the shared ones."""
    s = model.seq_len if seq_len is None else seq_len
    moe = moe_params(model)
    n = (model.n_layer * layer_params(model).total + moe.layers * moe.active_delta + norm_params(model)
         + model.vocab_size * model.d_model)
    return 6 * n + (6 if causal else 12) * model.n_layer * s * model.d_model


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs of one iteration over `batch` sequences, by part (Narayanan eq. 3's terms)."""

    dense: float      # 2 * B * s * L * (matmul weights per layer): 24 B s h^2 per layer for a GPT; an MoE
    #                   block counts the weights a token multiplies: router, k routed experts, shared experts
    attention: float  # QK^T and AV: 4 * B * s^2 * h per layer (halved when causal)
    logits: float     # 2 * B * s * h * V

    @property
    def total(self) -> float:
        return self.dense + self.attention + self.logits


def forward_flops(model: GPTConfig, *, batch: int, seq_len: int, causal: bool = False) -> ForwardFlops:
    """Two conventions, both stated wherever a number is printed: the papers' (Narayanan et al. 2021 eq. 3,
    Korthikanti et al. 2022 eqs. 7-8), every attention score computed, so QK^T and AV cost 4 * s^2 * h FLOPs per
    sequence per layer forward; and the causal one (current Megatron code, our GPT's `flops_per_token`; `causal`,
    `JobSpec.causal_flops`), where a causal mask leaves half of them, 2 * s^2 * h."""
    b, s, h, L = batch, seq_len, model.d_model, model.n_layer
    moe = moe_params(model)
    weights = L * layer_params(model).matmul + moe.layers * moe.active_matmul_delta
    return ForwardFlops(dense=2.0 * b * s * weights,
                        attention=4.0 * b * s * s * h * L * (0.5 if causal else 1.0),
                        logits=2.0 * b * s * h * model.vocab_size)


def iteration_flops(model: GPTConfig, *, batch: int, seq_len: int, recompute: Recompute = Recompute.NONE,
                    causal: bool = False) -> float:
    """FLOPs executed by one training iteration over `batch` sequences (hardware FLOPs).

    none:      3 x forward                          = Korthikanti eq. 7, 72 B s l h^2 (1 + s/6h + V/12lh)
    selective: eq. 8 as published, 72 B s l h^2 (1 + s/3h + V/12lh): the attention term doubles
    full:      4 x forward of the blocks, 3 x logits = Narayanan eq. 3, 96 B s l h^2 (1 + s/6h + V/16lh)
    The GPT forms above hold for d_ff = 4h and n_kv_head = n_head; other shapes use their own weights."""
    return training_flops(forward_flops(model, batch=batch, seq_len=seq_len, causal=causal), recompute)


def training_flops(f: ForwardFlops, recompute: Recompute = Recompute.NONE) -> float:
    """Forward + backward (+ recomputation) FLOPs from the forward's parts (see `iteration_flops`)."""
    if recompute is Recompute.FULL:
        return 4 * (f.dense + f.attention) + 3 * f.logits
    if recompute is Recompute.SELECTIVE:
        return 3 * f.dense + 6 * f.attention + 3 * f.logits
    return 3 * (f.dense + f.attention + f.logits)


def narayanan_train_seconds(*, tokens: float, num_params: float, num_gpus: int, achieved_flops: float) -> float:
    """Narayanan et al. 2021 eq. 4: time ~= 8 T P / (n X), X the achieved FLOP/s per GPU
    (8 = 6 + 2 for the recomputed forward)."""
    return 8.0 * tokens * num_params / (num_gpus * achieved_flops)


@dataclass(frozen=True)
class TrainingCost:
    """Totals for a training run; the FLOP figures are for the whole run."""

    params: int
    params_narayanan: float | None   # eq. 2, only for GPT-style models (GELU 4h MLP, learned positions)
    tokens: float
    flops_6nd: float
    flops_model: float               # no recomputation (what MFU counts)
    flops_full_recompute: float
    causal: bool

    def gpu_days(self, flops: float, flops_per_gpu: float) -> float:
        return flops / flops_per_gpu / SECONDS_PER_DAY


def training_cost(model: GPTConfig, *, tokens: float, seq_len: int, causal: bool = False) -> TrainingCost:
    """Parameters and the whole run's FLOPs by 6ND and by the Megatron formula (with and without
    full recomputation), over tokens / seq_len sequences."""
    count = param_count(model)
    sequences = tokens / seq_len
    gpt_like = (model.mlp == "gelu" and model.d_ff == 4 * model.d_model and model.bias
                and model.positions == "learned" and model.tie_embeddings
                and model.n_kv_head == model.n_head)
    return TrainingCost(
        params=count.total,
        params_narayanan=narayanan_params(n_layer=model.n_layer, d_model=model.d_model,
                                          vocab_size=model.vocab_size, seq_len=model.seq_len) if gpt_like else None,
        tokens=tokens,
        flops_6nd=six_nd(count.total, tokens),
        flops_model=iteration_flops(model, batch=1, seq_len=seq_len, causal=causal) * sequences,
        flops_full_recompute=iteration_flops(model, batch=1, seq_len=seq_len, recompute=Recompute.FULL,
                                             causal=causal) * sequences,
        causal=causal,
    )


def days(seconds: float) -> float:
    return seconds / SECONDS_PER_DAY
