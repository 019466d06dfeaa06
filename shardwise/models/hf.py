"""Our models and Hugging Face's: the transformers config that describes a `GPTConfig`, and the weight names and
layouts between the two, so a checkpoint exports to a model transformers loads and HF weights load into ours.

    GPT  (layernorm, gelu, learned positions, heads = kv heads)  <->  GPT2LMHeadModel
    Llama-style (rmsnorm, swiglu, rotary, no biases)              <->  LlamaForCausalLM
    Llama-style MoE (softmax top-k, k >= 2, no dropping)          <->  MixtralForCausalLM

GPT-2 keeps its projections in `Conv1D` layers, whose weight is [in, out] (ours, nn.Linear's, is [out, in]), and
fuses q, k and v into one `c_attn` [d, 3d]. Llama's names map one to one. Mixtral stacks a layer's E SwiGLU
experts: gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) and down_proj [E, H, I]; its router
`gate.weight` [E, H] is ours `gate.wg.weight`. Mixtral has no shared experts: ours are folded into every routed
expert, their hidden units appended to the expert's (I = moe_d_ff + the shared width). Exact, since each token's
top-k weights sum to 1 (k >= 2, no token dropped, weights normalized as Mixtral's are): sum_j w_j (e_j(x) + s(x)) =
sum_j w_j e_j(x) + s(x). Nothing here imports transformers except `hf_config`, which builds its config object.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardwise.errors import UserError
from shardwise.models.presets import GPTConfig


def hf_family(cfg: GPTConfig) -> str:
    """"gpt2", "llama" or "mixtral": the transformers architecture with this config's exact arithmetic; UserError
    if none."""
    if cfg.moe_experts:
        return _moe_family(cfg)
    if cfg.norm == "layernorm" and cfg.mlp == "gelu" and cfg.positions == "learned" and cfg.bias \
            and cfg.n_kv_head == cfg.n_head:
        return "gpt2"
    if cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.positions == "rotary" and not cfg.bias:
        return "llama"
    raise UserError(f"this model (norm={cfg.norm}, mlp={cfg.mlp}, positions={cfg.positions}, bias={cfg.bias}, "
                    f"n_kv_head={cfg.n_kv_head} of {cfg.n_head}) has no Hugging Face counterpart: export the "
                    f"GPT-2 shape (layernorm, gelu, learned positions, biases) or the Llama shape (rmsnorm, swiglu, "
                    f"rotary, no biases), or use --to safetensors for our own names")


def _moe_family(cfg: GPTConfig) -> str:
    """"mixtral", or one line naming what Mixtral cannot compute and the fix."""
    no = "this MoE model has no Hugging Face counterpart: "
    fix = "; or use --to safetensors for our own names"
    if not (cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.positions == "rotary" and not cfg.bias):
        raise UserError(f"{no}its experts are mlp={cfg.mlp} (norm={cfg.norm}, positions={cfg.positions}, "
                        f"bias={cfg.bias}) and Mixtral's are SwiGLU in the Llama shape (rmsnorm, swiglu, rotary, "
                        f"no biases): train the Llama shape (llama-moe-tiny){fix}")
    if cfg.moe_score != "softmax":
        raise UserError(f"{no}moe_score={cfg.moe_score}, Mixtral's router is a softmax: train with "
                        f"moe_score=softmax{fix}")
    if cfg.moe_top_k < 2:
        raise UserError(f"{no}moe_top_k={cfg.moe_top_k} weighs the expert by its score and Mixtral normalizes the "
                        f"top-k weights (a top-1 expert weighs 1): train with moe_top_k >= 2{fix}")
    if cfg.moe_capacity_factor is not None:
        raise UserError(f"{no}moe_capacity_factor={cfg.moe_capacity_factor} drops tokens over capacity and Mixtral "
                        f"never drops: train with moe_capacity_factor=None{fix}")
    if cfg.moe_first_dense:
        raise UserError(f"{no}moe_first_dense={cfg.moe_first_dense} keeps dense blocks and every Mixtral block is "
                        f"sparse: train with moe_first_dense=0{fix}")
    return "mixtral"


def _mixtral_width(cfg: GPTConfig) -> int:
    """Hidden units of one exported expert: its own and the shared experts' folded in."""
    assert cfg.moe_d_ff is not None         # GPTConfig resolves it
    return cfg.moe_d_ff * (1 + cfg.moe_shared_experts)


def hf_config_dict(cfg: GPTConfig) -> dict[str, Any]:
    """The `config.json` keys of the matching transformers model."""
    if hf_family(cfg) == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
                "n_positions": cfg.seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                "n_inner": cfg.d_ff, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
                "bos_token_id": None, "eos_token_id": None}
    if hf_family(cfg) == "mixtral":
        return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "intermediate_size": _mixtral_width(cfg),
                "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
                "num_key_value_heads": cfg.n_kv_head, "max_position_embeddings": cfg.seq_len,
                "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
                "attention_dropout": cfg.dropout, "sliding_window": None, "num_local_experts": cfg.moe_experts,
                "num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": cfg.moe_aux_loss_coef,
                "router_jitter_noise": 0.0, "initializer_range": cfg.init_std,
                "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": None, "eos_token_id": None,
                "pad_token_id": None}
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.dropout,
            "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def hf_config(cfg: GPTConfig) -> Any:
    """The transformers config object (needs transformers)."""
    from transformers import GPT2Config, LlamaConfig, MixtralConfig
    keys = {k: v for k, v in hf_config_dict(cfg).items() if k != "model_type"}
    return {"gpt2": GPT2Config, "llama": LlamaConfig, "mixtral": MixtralConfig}[hf_family(cfg)](**keys)


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


_LLAMA_ATTENTION = {k: v for k, v in _LLAMA_BLOCK.items() if not k.startswith("mlp.")}


def _mixtral_experts(cfg: GPTConfig, state: dict[str, Tensor], block: str) -> dict[str, Tensor]:
    """One MoE block's router and experts (ours under `block` = "blocks.i.mlp.") -> Mixtral's names under mlp."""
    shared = [state[f"{block}shared.{n}.weight"] for n in ("fc_gate", "fc_in", "fc_out")] \
        if cfg.moe_shared_experts else None
    gate_up, down = [], []
    for e in range(cfg.moe_experts):
        gate, up, out = (state[f"{block}experts.{e}.{n}.weight"] for n in ("fc_gate", "fc_in", "fc_out"))
        if shared is not None:          # the shared units appended: [I + Is, H] and [H, I + Is]
            gate, up, out = torch.cat([gate, shared[0]]), torch.cat([up, shared[1]]), torch.cat([out, shared[2]], 1)
        gate_up.append(torch.cat([gate, up]))                                  # [2I, H]
        down.append(out)                                                       # [H, I]
    return {"mlp.gate.weight": state[f"{block}gate.wg.weight"], "mlp.experts.gate_up_proj": torch.stack(gate_up),
            "mlp.experts.down_proj": torch.stack(down)}


def _mixtral_experts_back(cfg: GPTConfig, hf: dict[str, Tensor], layer: str) -> dict[str, Tensor]:
    """The inverse of `_mixtral_experts`: Mixtral's mlp under `layer` -> ours under "mlp." (the shared experts
    read from expert 0's appended units)."""
    assert cfg.moe_d_ff is not None
    width = cfg.moe_d_ff
    gate_up, down = hf[f"{layer}mlp.experts.gate_up_proj"], hf[f"{layer}mlp.experts.down_proj"]   # [E, 2I', H]
    total = gate_up.shape[1] // 2
    out = {"mlp.gate.wg.weight": hf[f"{layer}mlp.gate.weight"]}
    for e in range(cfg.moe_experts):
        gate, up = gate_up[e, :total], gate_up[e, total:]
        out[f"mlp.experts.{e}.fc_gate.weight"] = gate[:width].contiguous()
        out[f"mlp.experts.{e}.fc_in.weight"] = up[:width].contiguous()
        out[f"mlp.experts.{e}.fc_out.weight"] = down[e, :, :width].contiguous()
    if cfg.moe_shared_experts:
        out["mlp.shared.fc_gate.weight"] = gate_up[0, width:total].contiguous()
        out["mlp.shared.fc_in.weight"] = gate_up[0, total + width:].contiguous()
        out["mlp.shared.fc_out.weight"] = down[0, :, width:].contiguous()
    return out


def to_hf_state_dict(cfg: GPTConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our full state dict (single-process names) -> the transformers model's. A tied head is written once, as
    the embedding (transformers ties it back on load)."""
    family = hf_family(cfg)
    out: dict[str, Tensor] = {}
    if family in ("llama", "mixtral"):
        out["model.embed_tokens.weight"] = state["embed.tok.weight"]
        out["model.norm.weight"] = state["head.norm.weight"]
        for i in range(cfg.n_layer):
            for ours, theirs in (_LLAMA_BLOCK if family == "llama" else _LLAMA_ATTENTION).items():
                out[f"model.layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
            if family == "mixtral":
                for theirs, t in _mixtral_experts(cfg, state, f"blocks.{i}.mlp.").items():
                    out[f"model.layers.{i}.{theirs}"] = t
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
    if family in ("llama", "mixtral"):
        out["embed.tok.weight"] = hf["model.embed_tokens.weight"]
        out["head.norm.weight"] = hf["model.norm.weight"]
        for i in range(cfg.n_layer):
            for ours, theirs in (_LLAMA_BLOCK if family == "llama" else _LLAMA_ATTENTION).items():
                out[f"blocks.{i}.{ours}"] = hf[f"model.layers.{i}.{theirs}"]
            if family == "mixtral":
                for ours, t in _mixtral_experts_back(cfg, hf, f"model.layers.{i}.").items():
                    out[f"blocks.{i}.{ours}"] = t
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
