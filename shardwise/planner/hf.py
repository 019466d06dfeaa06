"""A `GPTConfig` from a Hugging Face `config.json` (read as JSON: transformers is not needed).

Supported `model_type`s: "gpt2" (GELU MLP, LayerNorm with biases, learned positions, tied head) and the
Llama family "llama", "mistral" (SwiGLU MLP, RMSNorm, rotary, grouped-query attention, no biases), and "mixtral"
(Mistral's shape with every MLP a mixture of `num_local_experts` SwiGLU experts of `intermediate_size`, top
`num_experts_per_tok`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from shardwise.models.presets import GPTConfig
from shardwise.planner.specs import PlannerError

LLAMA_FAMILY = ("llama", "mistral", "mixtral")
SUPPORTED = ("gpt2", *LLAMA_FAMILY)


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise PlannerError(f"--hf-config {os.fspath(path)!r}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise PlannerError(f"--hf-config {os.fspath(path)!r}: not valid JSON: line {e.lineno} column {e.colno}: "
                           f"{e.msg}") from None
    if not isinstance(data, dict):
        raise PlannerError(f"--hf-config {os.fspath(path)!r}: must hold a JSON object")
    return data


def _get(config: dict[str, Any], key: str, origin: str, default: Any = ...) -> Any:
    if key in config and config[key] is not None:
        return config[key]
    if default is ...:
        raise PlannerError(f"{origin}: key {key!r} is missing; a {config.get('model_type')!r} config needs it")
    return default


def model_from_hf_config(config: dict[str, Any] | str | os.PathLike) -> GPTConfig:
    """Translate the keys of a GPT-2 or Llama-family config.json (absent optional keys take transformers'
    defaults); the inverse of `shardwise.models.hf.hf_config_dict`."""
    origin = "Hugging Face config"
    if not isinstance(config, dict):
        origin = f"--hf-config {os.fspath(config)!r}"
        config = read_hf_config(config)
    kind = config.get("model_type")
    if kind == "gpt2":
        # One dropout rate in our model; the planner only asks whether dropout (and its masks) exists.
        dropout = max(float(config.get(k, 0.1) or 0) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
        return _config(
            origin, n_layer=_get(config, "n_layer", origin), d_model=_get(config, "n_embd", origin),
            n_head=_get(config, "n_head", origin), d_ff=_get(config, "n_inner", origin, None),
            vocab_size=_get(config, "vocab_size", origin), seq_len=_get(config, "n_positions", origin),
            mlp="gelu", norm="layernorm", positions="learned", bias=True,
            norm_eps=_get(config, "layer_norm_epsilon", origin, 1e-5),
            init_std=_get(config, "initializer_range", origin, 0.02),
            tie_embeddings=bool(_get(config, "tie_word_embeddings", origin, True)), dropout=dropout)
    if kind in LLAMA_FAMILY:
        attention_bias = bool(config.get("attention_bias", False))
        mlp_bias = bool(config.get("mlp_bias", False))
        if attention_bias or mlp_bias:
            raise PlannerError(f"{origin}: attention_bias / mlp_bias = true is not modelled (the planner's "
                               f"Llama shape has no biases); give the shape with --layers/--hidden/... instead")
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise PlannerError(f"{origin}: hidden_act = {act!r}: the Llama family is modelled with a SwiGLU "
                               f"(silu) MLP only")
        heads = _get(config, "num_attention_heads", origin)
        moe: dict[str, Any] = {}
        if kind == "mixtral":    # every block's MLP is a router over experts of the dense MLP's shape
            moe = dict(moe_experts=_get(config, "num_local_experts", origin, 8),
                       moe_top_k=_get(config, "num_experts_per_tok", origin, 2),
                       moe_aux_loss_coef=float(_get(config, "router_aux_loss_coef", origin, 0.001)))
        return _config(
            origin, n_layer=_get(config, "num_hidden_layers", origin), d_model=_get(config, "hidden_size", origin),
            n_head=heads, n_kv_head=_get(config, "num_key_value_heads", origin, heads),
            d_ff=_get(config, "intermediate_size", origin), vocab_size=_get(config, "vocab_size", origin),
            seq_len=_get(config, "max_position_embeddings", origin), mlp="swiglu", norm="rmsnorm",
            positions="rotary", bias=False, norm_eps=_get(config, "rms_norm_eps", origin, 1e-6),
            rope_theta=_get(config, "rope_theta", origin, 10000.0),
            init_std=_get(config, "initializer_range", origin, 0.02),
            tie_embeddings=bool(_get(config, "tie_word_embeddings", origin, False)),
            dropout=float(config.get("attention_dropout", 0.0) or 0), **moe)
    raise PlannerError(f"{origin}: model_type = {kind!r} is not supported; supported: {', '.join(SUPPORTED)}. "
                       f"Give the shape as numbers instead (--layers, --hidden, --heads, --kv-heads, --ffn, "
                       f"--vocab, --seq)")


def _config(origin: str, **fields: Any) -> GPTConfig:
    try:
        return GPTConfig(**fields)
    except ValueError as e:
        raise PlannerError(f"{origin}: {e}") from None
