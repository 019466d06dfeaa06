"""Our models and Hugging Face's: the transformers config that describes a `GPTConfig`, and the weight names and
layouts between the two, so a checkpoint exports to a model transformers loads and HF weights load into ours.

    GPT  (layernorm, gelu, learned positions, heads = kv heads)  <->  GPT2LMHeadModel
    Llama-style (rmsnorm, swiglu, rotary, no biases)              <->  LlamaForCausalLM

GPT-2 keeps its projections in `Conv1D` layers, whose weight is [in, out] (ours, nn.Linear's, is [out, in]), and
fuses q, k and v into one `c_attn` [d, 3d]. Llama's names map one to one. Nothing here imports transformers
except `hf_config`, which builds its config object.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardwise.errors import UserError
from shardwise.models.presets import GPTConfig


def hf_family(cfg: GPTConfig) -> str:
    """"gpt2" or "llama": the transformers architecture with this config's exact arithmetic; UserError if none."""
    if cfg.norm == "layernorm" and cfg.mlp == "gelu" and cfg.positions == "learned" and cfg.bias \
            and cfg.n_kv_head == cfg.n_head:
        return "gpt2"
    if cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.positions == "rotary" and not cfg.bias:
        return "llama"
    raise UserError(f"this model (norm={cfg.norm}, mlp={cfg.mlp}, positions={cfg.positions}, bias={cfg.bias}, "
                    f"n_kv_head={cfg.n_kv_head} of {cfg.n_head}) has no Hugging Face counterpart: export the "
                    f"GPT-2 shape (layernorm, gelu, learned positions, biases) or the Llama shape (rmsnorm, swiglu, "
                    f"rotary, no biases), or use --to safetensors for our own names")


def hf_config_dict(cfg: GPTConfig) -> dict[str, Any]:
    """The `config.json` keys of the matching transformers model."""
    if hf_family(cfg) == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
                "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                "n_inner": cfg.d_ff, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
                "bos_token_id": None, "eos_token_id": None}
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.dropout,
            "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def hf_config(cfg: GPTConfig) -> Any:
    """The transformers config object (needs transformers)."""
    from transformers import GPT2Config, LlamaConfig
    keys = {k: v for k, v in hf_config_dict(cfg).items() if k != "model_type"}
    return (GPT2Config if hf_family(cfg) == "gpt2" else LlamaConfig)(**keys)


_LLAMA_BLOCK = {  # ours (under blocks.i.) -> transformers' (under model.layers.i.)
    "ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight", "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight", "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.fc_gate.weight": "mlp.gate_proj.weight", "mlp.fc_in.weight": "mlp.up_proj.weight",
    "mlp.fc_out.weight": "mlp.down_proj.weight",
}
_GPT2_BLOCK = {  # ours -> transformers' (under transformer.h.i.); Conv1D weights are transposed
    "ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias", "ln_2.weight": "ln_2.weight", "ln_2.bias": "ln_2.bias",
    "attn.o_proj.weight": "attn.c_proj.weight", "attn.o_proj.bias": "attn.c_proj.bias",
    "mlp.fc_in.weight": "mlp.c_fc.weight", "mlp.fc_in.bias": "mlp.c_fc.bias",
    "mlp.fc_out.weight": "mlp.c_proj.weight", "mlp.fc_out.bias": "mlp.c_proj.bias",
}


def to_hf_state_dict(cfg: GPTConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our full state dict (single-process names) -> the transformers model's. A tied head is written once, as
    the embedding (transformers ties it back on load)."""
    family = hf_family(cfg)
    out: dict[str, Tensor] = {}
    if family == "llama":
        out["model.embed_tokens.weight"] = state["embed.tok.weight"]
        out["model.norm.weight"] = state["head.norm.weight"]
        for i in range(cfg.n_layer):
            for ours, theirs in _LLAMA_BLOCK.items():
                out[f"model.layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = state["head.lm_head.weight"]
        return out
    out["transformer.wte.weight"] = state["embed.tok.weight"]
    out["transformer.wpe.weight"] = state["embed.pos.weight"]
    out["transformer.ln_f.weight"] = state["head.norm.weight"]
    out["transformer.ln_f.bias"] = state["head.norm.bias"]
    for i in range(cfg.n_layer):
        ours = f"blocks.{i}."
        theirs = f"transformer.h.{i}."
        for a, b in _GPT2_BLOCK.items():
            t = state[ours + a]
            out[theirs + b] = t.t().contiguous() if t.dim() == 2 else t       # Linear [out, in] -> Conv1D [in, out]
        qkv = [state[f"{ours}attn.{p}_proj.weight"] for p in "qkv"]            # 3 x [d, d]
        out[theirs + "attn.c_attn.weight"] = torch.cat(qkv, dim=0).t().contiguous()        # [d, 3d]
        out[theirs + "attn.c_attn.bias"] = torch.cat([state[f"{ours}attn.{p}_proj.bias"] for p in "qkv"])
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["head.lm_head.weight"]
    return out


def from_hf_state_dict(cfg: GPTConfig, hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of `to_hf_state_dict`: transformers' weights under our names (a tied head filled in)."""
    family = hf_family(cfg)
    out: dict[str, Tensor] = {}
    if family == "llama":
        out["embed.tok.weight"] = hf["model.embed_tokens.weight"]
        out["head.norm.weight"] = hf["model.norm.weight"]
        for i in range(cfg.n_layer):
            for ours, theirs in _LLAMA_BLOCK.items():
                out[f"blocks.{i}.{ours}"] = hf[f"model.layers.{i}.{theirs}"]
        out["head.lm_head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
        return out
    out["embed.tok.weight"] = hf["transformer.wte.weight"]
    out["embed.pos.weight"] = hf["transformer.wpe.weight"]
    out["head.norm.weight"] = hf["transformer.ln_f.weight"]
    out["head.norm.bias"] = hf["transformer.ln_f.bias"]
    d = cfg.d_model
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in _GPT2_BLOCK.items():
            t = hf[theirs + b]
            out[ours + a] = t.t().contiguous() if t.dim() == 2 else t
        w, bias = hf[theirs + "attn.c_attn.weight"].t(), hf[theirs + "attn.c_attn.bias"]   # [3d, d], [3d]
        for j, p in enumerate("qkv"):
            out[f"{ours}attn.{p}_proj.weight"] = w[j * d:(j + 1) * d].contiguous()
            out[f"{ours}attn.{p}_proj.bias"] = bias[j * d:(j + 1) * d].contiguous()
    out["head.lm_head.weight"] = hf.get("lm_head.weight", hf["transformer.wte.weight"])
    return out
