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


@dataclass(frozen=True)
class ParamCount:
    """Every parameter of the model, a tied lm head counted once."""

    layers: int          # all transformer blocks
    token_embedding: int
    position_embedding: int
    final_norm: int
    lm_head: int         # 0 when tied to the token embedding

    @property
    def total(self) -> int:
        return self.layers + self.token_embedding + self.position_embedding + self.final_norm + self.lm_head

    @property
    def non_embedding(self) -> int:
        """Kaplan et al.'s N: without the token and position tables (an untied head stays in)."""
        return self.total - self.token_embedding - self.position_embedding


@functools.cache
def param_count(model: GPTConfig) -> ParamCount:
    """Exact parameter count; equals `shardwise.models.gpt_num_params` for our GPT."""
    d = model.d_model
    return ParamCount(
        layers=model.n_layer * layer_params(model).total,
        token_embedding=model.vocab_size * d,
        position_embedding=model.seq_len * d if model.positions == "learned" else 0,
        final_norm=norm_params(model),
        lm_head=0 if model.tie_embeddings else model.vocab_size * d,
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
def params_per_stage(model: GPTConfig, *, tp: int, pp: int) -> tuple[int, ...]:
    """Parameters held by one TP rank of each pipeline stage. The first stage holds the token (and
    position) tables; the last the final norm and the lm head, or with a tied head on pp > 1 a copy of
    the token table (Megatron keeps one there and all-reduces its gradient). Vocabulary-parallel
    tables are split over TP; position tables are replicated."""
    count = param_count(model)
    per_layer = layer_params(model).per_tp_rank(tp)
    vocab_table = _ceil_div(model.vocab_size, tp) * model.d_model
    stages = [n * per_layer for n in stage_layers(model.n_layer, pp)]
    stages[0] += vocab_table + count.position_embedding
    stages[-1] += count.final_norm
    if not model.tie_embeddings or pp > 1:
        stages[-1] += vocab_table
    return tuple(stages)


def params_per_rank(model: GPTConfig, *, tp: int = 1, pp: int = 1) -> int:
    """The most parameters any rank holds (what its memory must fit). tp = pp = 1: the total."""
    return max(params_per_stage(model, tp=tp, pp=pp))


# -- FLOPs -----------------------------------------------------------------------------------------

def six_nd(num_params: float, tokens: float) -> float:
    """Kaplan et al. 2020: training costs 6 FLOPs per parameter per token (2 forward, 4 backward)."""
    return 6.0 * num_params * tokens


def flops_per_token(model: GPTConfig, *, seq_len: int | None = None, causal: bool = True) -> int:
    """Training FLOPs per token without recomputation, counted as our GPT does:
    6 * N + (6 if causal else 12) * n_layer * s * d_model, where N is every parameter a token's matmuls
    touch (blocks, final norm, and the lm head's V * d whether or not tied). With causal=True and
    s = the model's context this equals `shardwise.models.gpt_flops_per_token`."""
    s = model.seq_len if seq_len is None else seq_len
    n = model.n_layer * layer_params(model).total + norm_params(model) + model.vocab_size * model.d_model
    return 6 * n + (6 if causal else 12) * model.n_layer * s * model.d_model


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs of one iteration over `batch` sequences, by part (Narayanan eq. 3's terms)."""

    dense: float      # 2 * B * s * L * (matmul weights per layer): 24 B s h^2 per layer for a GPT
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
    return ForwardFlops(dense=2.0 * b * s * L * layer_params(model).matmul,
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
