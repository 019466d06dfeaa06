"""GPT configuration, named presets and the pure parameter / FLOP arithmetic (no torch import).

`GPTConfig` is also the planner's model description (`shardwise.planner` sizes any config without torch).
`gpt_num_params` and `gpt_flops_per_token` compute from a config alone what the built model reports
(`GPT.num_params`, `GPT.flops_per_token`); the planner counts the same by parts, and tests keep the two equal.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Literal, get_args

Positions = Literal["learned", "rotary"]
"""learned: a [seq_len, d_model] table added to the token embeddings (GPT-2).
rotary: queries and keys are rotated per position inside attention (RoPE); no parameters."""

_POSITIONS: tuple[str, ...] = get_args(Positions)

Norm = Literal["layernorm", "rmsnorm"]
"""layernorm: (x - mean) / std * weight (+ bias) (GPT-2). rmsnorm: x / rms(x) * weight, no bias (Llama)."""

MLPKind = Literal["gelu", "swiglu"]
"""gelu: fc_out(gelu(fc_in(x))), d_ff = 4 d (GPT-2). swiglu: fc_out(silu(fc_gate(x)) * fc_in(x)), three
matrices, d_ff = Llama's round_up(8 d / 3, 256)."""

_NORMS: tuple[str, ...] = get_args(Norm)
_MLPS: tuple[str, ...] = get_args(MLPKind)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a decoder-only transformer. `d_ff` and `n_kv_head` given as None are resolved at
    construction (4 * d_model and n_head), so a built config always holds plain ints."""

    vocab_size: int = 256
    """Token ids are 0 .. vocab_size - 1; 256 is the byte-level tokenizer."""
    seq_len: int = 128
    """Longest sequence the model accepts (size of the learned position table)."""
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int | None = None
    """Hidden width of the MLP; None means 4 * d_model (gelu) or round_up(8 * d_model / 3, 256) (swiglu)."""
    n_kv_head: int | None = None
    """Key/value heads; fewer than n_head is grouped-query attention. None means n_head."""
    positions: Positions = "learned"
    dropout: float = 0.0
    """Applied to embeddings, attention probabilities and both residual branches while training."""
    bias: bool = True
    """Biases in every Linear (except the lm-head, which never has one) and in the LayerNorms."""
    tie_embeddings: bool = False
    """The lm-head reuses the token-embedding matrix (GPT-2 does)."""
    norm_eps: float = 1e-5
    init_std: float = 0.02
    """Std of the normal init; residual output projections use init_std / sqrt(2 * n_layer)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (only read when positions == "rotary")."""
    norm: Norm = "layernorm"
    mlp: MLPKind = "gelu"
    moe_experts: int = 0
    """Routed experts per MoE layer; 0: every block has the dense MLP. Each expert is the `mlp` kind of width
    moe_d_ff."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    moe_d_ff: int | None = None
    """Hidden width of one expert (routed or shared); None means d_ff."""
    moe_shared_experts: int = 0
    """Experts every token passes through beside the routed ones (DeepSeek-MoE), as one MLP of
    moe_shared_experts * moe_d_ff width."""
    moe_first_dense: int = 0
    """The first blocks keep the dense MLP of width d_ff (DeepSeek-MoE's first layer)."""
    moe_score: Literal["softmax", "sigmoid"] = "softmax"
    moe_capacity_factor: float | None = None
    """Tokens an expert takes per rank, as a multiple of an even share (times k); None: no token is dropped."""
    moe_aux_loss_coef: float = 0.01
    """Coefficient of the load-balancing loss added to the training loss."""
    moe_z_loss_coef: float = 0.0
    """Coefficient of the router z-loss added to the training loss."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            _require_positive_int(name, getattr(self, name))
        if self.d_ff is None:
            d_ff = 4 * self.d_model if self.mlp == "gelu" else 256 * -(-8 * self.d_model // (3 * 256))
            object.__setattr__(self, "d_ff", d_ff)
        n_kv_head = self.n_head if self.n_kv_head is None else self.n_kv_head
        object.__setattr__(self, "n_kv_head", n_kv_head)
        _require_positive_int("d_ff", self.d_ff)
        _require_positive_int("n_kv_head", n_kv_head)
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                             f"each head gets d_model / n_head features. Choose n_head dividing d_model.")
        if self.n_head % n_kv_head:
            raise ValueError(f"GPTConfig: n_head={self.n_head} is not divisible by n_kv_head={n_kv_head}; "
                             f"each key/value head serves an equal group of query heads. "
                             f"Choose n_kv_head dividing n_head (n_kv_head=n_head is plain multi-head attention).")
        if self.norm not in _NORMS:
            raise ValueError(f"GPTConfig: norm={self.norm!r} is not one of {list(_NORMS)}.")
        if self.mlp not in _MLPS:
            raise ValueError(f"GPTConfig: mlp={self.mlp!r} is not one of {list(_MLPS)}.")
        if self.moe_experts:
            if isinstance(self.moe_experts, bool) or not isinstance(self.moe_experts, int) or self.moe_experts < 0:
                raise ValueError(f"GPTConfig: moe_experts={self.moe_experts!r} must be a non-negative integer.")
            if not 1 <= self.moe_top_k <= self.moe_experts:
                raise ValueError(f"GPTConfig: moe_top_k={self.moe_top_k} with moe_experts={self.moe_experts}; each "
                                 f"token picks k distinct experts: choose 1 <= moe_top_k <= moe_experts.")
            if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
                raise ValueError(f"GPTConfig: moe_capacity_factor={self.moe_capacity_factor} must be > 0 "
                                 f"(None: no token is dropped).")
            if self.moe_d_ff is None:
                object.__setattr__(self, "moe_d_ff", self.d_ff)
        if self.positions not in _POSITIONS:
            raise ValueError(f"GPTConfig: positions={self.positions!r} is not one of {list(_POSITIONS)}.")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"GPTConfig: positions='rotary' needs an even head dim, but d_model / n_head = "
                             f"{self.d_model} / {self.n_head} = {self.head_dim}; rotary rotates feature pairs. "
                             f"Change d_model or n_head, or use positions='learned'.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout} must be in [0, 1).")
        for name in ("norm_eps", "init_std", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GPTConfig: {name}={getattr(self, name)} must be > 0.")

    def is_moe_block(self, index: int) -> bool:
        """Whether block `index` has an MoE layer in place of the dense MLP."""
        return self.moe_experts > 0 and index >= self.moe_first_dense

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection output: n_kv_head * head_dim."""
        assert self.n_kv_head is not None
        return self.n_kv_head * self.head_dim


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GPTConfig: {name}={value!r} must be a positive integer.")


# -- presets ---------------------------------------------------------------------------------------

# Kept as keyword dicts so that `gpt_config(name, d_model=...)` re-derives d_ff from the new width
# instead of inheriting the preset's resolved 4 * d_model. This is the one table of named models: `shardwise
# train --model NAME` builds them and the planner (`shardwise plan --model NAME`) sizes them.
_GPT2_FAMILY = dict(vocab_size=50257, positions="learned", tie_embeddings=True)
# GPT-3 (Brown et al. 2020, arXiv:2005.14165, Table 2.1): GPT-2's vocabulary and tied embeddings, context
# 2048, dropout 0.1 as GPT-2. Head counts follow d_head = 128 where the table's are inconsistent with it.
_GPT3 = dict(_GPT2_FAMILY, seq_len=2048, dropout=0.1)
# The Llama architecture (Touvron et al. 2023): RMSNorm, SwiGLU MLP, rotary positions, no biases, an untied
# head, Llama's 32000-token vocabulary.
_LLAMA = dict(vocab_size=32000, positions="rotary", norm="rmsnorm", mlp="swiglu", bias=False,
              tie_embeddings=False)
_PRESET_KWARGS: dict[str, dict[str, Any]] = {
    # ~1.9M params, byte-level: trains in seconds on one CPU core; the default for tests and the demo.
    "tiny": dict(vocab_size=256, seq_len=128, n_layer=4, n_head=6, d_model=192),
    # ~10.7M params, byte-level.
    "small": dict(vocab_size=256, seq_len=256, n_layer=6, n_head=6, d_model=384),
    # GPT-2 small: 124,439,808 params (tied embeddings, as the released checkpoint).
    "gpt2-124m": dict(_GPT2_FAMILY, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    # GPT-2 medium shape: 354,823,168 params.
    "350m": dict(_GPT2_FAMILY, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
    # GPT-3 XL shape (24 layers, 2048 wide, 2048 context): ~1.32B params.
    "1.3b": dict(_GPT2_FAMILY, seq_len=2048, n_layer=24, n_head=16, d_model=2048),
    "gpt3-125m": dict(_GPT3, n_layer=12, n_head=12, d_model=768),
    "gpt3-350m": dict(_GPT3, n_layer=24, n_head=16, d_model=1024),
    "gpt3-760m": dict(_GPT3, n_layer=24, n_head=16, d_model=1536),
    "gpt3-1.3b": dict(_GPT3, n_layer=24, n_head=16, d_model=2048),
    "gpt3-2.7b": dict(_GPT3, n_layer=32, n_head=32, d_model=2560),
    "gpt3-6.7b": dict(_GPT3, n_layer=32, n_head=32, d_model=4096),
    "gpt3-13b": dict(_GPT3, n_layer=40, n_head=40, d_model=5120),
    # 96 layers, 12288 wide, 96 heads: 174.6e9 parameters (Table D.1's N).
    "gpt3-175b": dict(_GPT3, n_layer=96, n_head=96, d_model=12288),
    # Llama-style and byte-level, small enough for CPU: grouped-query attention (6 query heads, 2 kv heads).
    "llama-tiny": dict(_LLAMA, vocab_size=256, seq_len=128, n_layer=4, n_head=6, n_kv_head=2, d_model=192),
    "llama-small": dict(_LLAMA, vocab_size=256, seq_len=256, n_layer=6, n_head=6, n_kv_head=2, d_model=384),
    # LLaMA 7B (arXiv:2302.13971): 32 x 4096, 32 heads, SwiGLU 11008, context 2048: 6,738,415,616 params.
    "llama-7b": dict(_LLAMA, seq_len=2048, n_layer=32, n_head=32, d_model=4096, d_ff=11008, norm_eps=1e-6),
    # Llama 2 13B (arXiv:2307.09288): 40 x 5120, 40 heads, SwiGLU 13824, context 4096.
    "llama-13b": dict(_LLAMA, seq_len=4096, n_layer=40, n_head=40, d_model=5120, d_ff=13824),
    # Llama 2 70B: 80 x 8192, 64 query heads sharing 8 kv heads, SwiGLU 28672, context 4096: 68,976,648,192.
    "llama-70b": dict(_LLAMA, seq_len=4096, n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_ff=28672),
}
# Mixtures of experts, a table of their own beside `PRESETS`; `--model`, `gpt_config` and the planner (whose model
# table joins the two) find them.
_MOE_PRESET_KWARGS: dict[str, dict[str, Any]] = {
    # tiny's shape with 4 GELU experts of half width, top-2: trains on CPU.
    "gpt-moe-tiny": dict(vocab_size=256, seq_len=128, n_layer=4, n_head=6, d_model=192, moe_experts=4,
                         moe_top_k=2, moe_d_ff=384),
    # llama-tiny's shape with 4 SwiGLU experts, top-2, one shared expert.
    "llama-moe-tiny": dict(_LLAMA, vocab_size=256, seq_len=128, n_layer=4, n_head=6, n_kv_head=2, d_model=192,
                           moe_experts=4, moe_top_k=2, moe_d_ff=256, moe_shared_experts=1),
    # Mixtral 8x7B (arXiv:2401.04088): Mistral 7B's shape (32 x 4096, 32 heads, 8 kv heads, SwiGLU 14336) with 8
    # experts per layer, top-2, rope theta 1e6, context 32768: 46,702,792,704 parameters.
    "mixtral-8x7b": dict(_LLAMA, seq_len=32768, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336,
                         rope_theta=1e6, moe_experts=8, moe_top_k=2, moe_aux_loss_coef=0.02),
    # DeepSeek-MoE 16B (arXiv:2401.06066): 28 x 2048, 16 heads, vocabulary 102400, a dense first layer (SwiGLU
    # 10944), then 64 routed experts of 1408 (top-6) and 2 shared ones: 16,375,728,128 parameters.
    "deepseek-moe-16b": dict(_LLAMA, vocab_size=102400, seq_len=4096, n_layer=28, n_head=16, d_model=2048,
                             d_ff=10944, moe_experts=64, moe_top_k=6, moe_d_ff=1408, moe_shared_experts=2,
                             moe_first_dense=1, moe_aux_loss_coef=0.001),
}

PRESETS: dict[str, GPTConfig] = {name: GPTConfig(**kw) for name, kw in _PRESET_KWARGS.items()}
"""Preset name -> config. Use `gpt_config(name, **overrides)` to derive variants."""

MOE_PRESETS: dict[str, GPTConfig] = {name: GPTConfig(**kw) for name, kw in _MOE_PRESET_KWARGS.items()}
"""The mixture-of-experts presets (the planner sizes them with `PRESETS`: `planner.MODEL_PRESETS`)."""

_FIELDS = tuple(f.name for f in dataclasses.fields(GPTConfig))


def preset_name(cfg: GPTConfig) -> str | None:
    """The name of the preset `cfg` equals field for field, or None: what reports call a model."""
    return next((name for name, preset in PRESETS.items() if preset == cfg), None)


def gpt_config(name: str, **overrides: Any) -> GPTConfig:
    """The preset `name` (case-insensitive) with `overrides` applied, e.g.
    `gpt_config("tiny", n_layer=2, positions="rotary")`. Fields left at None (d_ff, n_kv_head) are
    re-derived from the overridden shape."""
    key = name.strip().lower()
    table = {**_PRESET_KWARGS, **_MOE_PRESET_KWARGS}
    if key not in table:
        valid = list(table)
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown GPT preset {name!r}; valid presets are {', '.join(valid)}.{hint}")
    unknown = [k for k in overrides if k not in _FIELDS]
    if unknown:
        hints = [f"{k!r} (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(k, _FIELDS, n=1)) else repr(k)
                 for k in unknown]
        raise ValueError(f"gpt_config({name!r}): unknown field(s) {', '.join(hints)}; "
                         f"GPTConfig fields are {', '.join(_FIELDS)}.")
    return GPTConfig(**{**table[key], **overrides})


# -- pure counting ---------------------------------------------------------------------------------

def gpt_num_params(cfg: GPTConfig, *, exclude_embeddings: bool = False) -> int:
    """Exact parameter count of `GPT(cfg)`, a tied lm-head counted once.

    exclude_embeddings drops the token-embedding table and the learned position table (Kaplan et
    al.'s "non-embedding" N). An untied lm-head weight stays in; a tied one is the token table and
    goes with it."""
    d, f, kv, b = cfg.d_model, cfg.d_ff, cfg.kv_dim, int(cfg.bias)
    assert f is not None
    norm = d * (1 + b) if cfg.norm == "layernorm" else d   # LayerNorm weight (+ bias); RMSNorm weight
    attn = (d * d + d * b) * 2 + (d * kv + kv * b) * 2   # q_proj, o_proj: d -> d; k_proj, v_proj: d -> kv
    mlp_in = 2 if cfg.mlp == "swiglu" else 1             # SwiGLU: fc_gate and fc_in

    def mlp_of(width: int) -> int:
        return mlp_in * (d * width + width * b) + (width * d + d * b)     # fc_in (+ fc_gate), fc_out

    mlp = mlp_of(f)
    blocks = cfg.n_layer * (2 * norm + attn + mlp)
    if cfg.moe_experts:
        e = cfg.moe_d_ff
        assert e is not None
        # router d -> E (no bias), the routed experts, the shared experts as one MLP of their summed width
        moe = d * cfg.moe_experts + cfg.moe_experts * mlp_of(e) + (mlp_of(cfg.moe_shared_experts * e)
                                                                   if cfg.moe_shared_experts else 0)
        moe_blocks = sum(cfg.is_moe_block(i) for i in range(cfg.n_layer))
        blocks += moe_blocks * (moe - mlp)
    token_table = cfg.vocab_size * d
    position_table = cfg.seq_len * d if cfg.positions == "learned" else 0
    lm_head = 0 if cfg.tie_embeddings else cfg.vocab_size * d   # never a bias
    total = token_table + position_table + blocks + norm + lm_head
    if exclude_embeddings:
        total -= token_table + position_table
    return total


def gpt_flops_per_token(cfg: GPTConfig) -> int:
    """Training FLOPs (forward + backward) per token at full context, by the convention

        6 * N + 6 * n_layer * seq_len * d_model

    N is every parameter that takes part in a per-token matmul: the non-embedding parameters plus the
    lm-head's vocab_size * d_model weights (counted whether or not tied: the head matmul runs either
    way). Embedding lookups cost nothing; norms and biases are inside N (as in 6N, they are noise).
    Each weight costs 2 FLOPs per token forward and 4 backward, hence 6 * N. The attention scores
    QK^T and the mix AV cost 2 * seq_len * d_model each per layer per token forward (4 * L * s * d),
    times 3 for training is 12 * L * s * d (PaLM's 12LHQT), halved because a causal mask leaves
    on average half the keys: 6 * L * s * d. Grouped-query attention does not change it (every query
    head still scores s keys). In an MoE block a token runs only its top-k routed experts: the others are left
    out of N."""
    n = gpt_num_params(cfg, exclude_embeddings=True) - _idle_expert_params(cfg)
    if cfg.tie_embeddings:
        n += cfg.vocab_size * cfg.d_model
    return 6 * n + 6 * cfg.n_layer * cfg.seq_len * cfg.d_model


def _idle_expert_params(cfg: GPTConfig) -> int:
    """Parameters of the routed experts a token does not run: (E - k) experts in each MoE block."""
    if not cfg.moe_experts:
        return 0
    e, d, b = cfg.moe_d_ff, cfg.d_model, int(cfg.bias)
    assert e is not None
    expert = (2 if cfg.mlp == "swiglu" else 1) * (d * e + e * b) + (e * d + d * b)
    return sum(cfg.is_moe_block(i) for i in range(cfg.n_layer)) * (cfg.moe_experts - cfg.moe_top_k) * expert
