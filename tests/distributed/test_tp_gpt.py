"""Tensor-parallel training through the engine equals single-process training: the GPT at T = 4 (dp 1) and
T = 2 x dp 2 on 4 ranks, with and without sequence parallelism (learned and rotary positions, tied embeddings,
grouped-query attention, gradient accumulation, clipping, Adam and SGD with momentum), and our Llama-style
model; losses and gathered parameters after 5 steps, rtol 1e-5; the per-step TP traffic is Megatron's. Also
Hugging Face-style models parallelized from their own tp plan at T = 2 x dp 2: a fake Llama written like
pre-4.48 transformers (head counts used in reshapes) and, when transformers is installed, the real LlamaForCausalLM."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.testing import (
    assert_close_lists, assert_state_close, lm_pair, mean_over_ranks, micro_steps, reference_train, run_distributed,
    shard_global_batch, state_copy, tiny_gpt, token_batches,
)

STEPS, GLOBAL_BATCH, SEQ = 5, 8, 16
N_LAYER, D_MODEL = 2, 32
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}

LLAMA = dict(positions="rotary", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2, d_ff=64)
GPT_CASES = {
    "tp4": dict(tp=4, sp=False, gpt=dict(), optimizer=ADAMW, gas=1, clip=0.3),
    "tp4_sp_tied": dict(tp=4, sp=True, gpt=dict(tie_embeddings=True), optimizer=SGD, gas=2, clip=0.3),
    "tp2_dp2_rotary_gqa": dict(tp=2, sp=False, gpt=dict(positions="rotary", n_kv_head=2), optimizer=SGD, gas=1,
                               clip=0.3),
    "tp2_dp2_sp_rotary": dict(tp=2, sp=True, gpt=dict(positions="rotary"), optimizer=ADAMW, gas=2, clip=1.0),
    # Our Llama-style model (RMSNorm, SwiGLU, rotary, GQA, no biases), without and with sequence parallelism.
    "tp2_dp2_llama": dict(tp=2, sp=False, gpt=dict(LLAMA), optimizer=SGD, gas=1, clip=0.3),
    "tp2_dp2_sp_llama": dict(tp=2, sp=True, gpt=dict(LLAMA), optimizer=ADAMW, gas=2, clip=0.3),
}
HF_OPTIMIZER = {"fake_llama": ADAMW, "llama": SGD}


# -- models -----------------------------------------------------------------------------------------------

def gpt(case: dict) -> nn.Module:
    return tiny_gpt(n_layer=N_LAYER, d_model=D_MODEL, seq_len=SEQ, **case["gpt"])


class FakeLlamaConfig:
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
    }
    vocab_size, hidden_size, intermediate_size = 64, 32, 64
    num_attention_heads, num_key_value_heads, num_hidden_layers = 4, 2, 2


class FakeRMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class FakeAttention(nn.Module):
    """Reshapes with its head-count attributes, as transformers' attention did before `view(.., -1, hd)`."""

    def __init__(self, cfg: FakeLlamaConfig):
        super().__init__()
        self.num_heads, self.num_key_value_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hidden_size, self.head_dim = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        kv = self.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.hidden_size)), None


class FakeMLP(nn.Module):
    def __init__(self, cfg: FakeLlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FakeDecoderLayer(nn.Module):
    def __init__(self, cfg: FakeLlamaConfig):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = FakeRMSNorm(cfg.hidden_size), FakeRMSNorm(cfg.hidden_size)
        self.self_attn, self.mlp = FakeAttention(cfg), FakeMLP(cfg)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attn, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states))   # HF passes keywords
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class FakeLlamaModel(nn.Module):
    def __init__(self, cfg: FakeLlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(FakeDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = FakeRMSNorm(cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class FakeLlamaForCausalLM(nn.Module):
    base_model_prefix = "model"
    _tp_plan = {"lm_head": "colwise_rep"}

    def __init__(self, cfg: FakeLlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = FakeLlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model(input_ids))                   # [b, s, V], gathered by colwise_rep
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def hf_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "fake_llama":
        return FakeLlamaForCausalLM(FakeLlamaConfig())
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))


def hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    return out if torch.is_tensor(out) else out.loss


def hf_names() -> list[str]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ["fake_llama"]
    return list(HF_OPTIMIZER)


# -- data and reference -----------------------------------------------------------------------------------

def global_batches(vocab: int, seq: int) -> list[torch.Tensor]:
    """STEPS global batches [GLOBAL_BATCH, seq] of tokens below `vocab`."""
    return token_batches(STEPS, GLOBAL_BATCH, seq, seed=7, vocab=vocab)


def reference_optimizer(spec: dict, params) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if spec["type"] == "AdamW" else torch.optim.SGD
    return cls(params, **spec["params"])


def run_gpt_reference(case: dict) -> tuple[list[float], dict]:
    model = gpt(case)
    steps = micro_steps(global_batches(256, SEQ + 1), grad_accum=case["gas"])
    losses = reference_train(model, reference_optimizer(case["optimizer"], model.parameters()), steps,
                             loss_fn=lambda m, mb: m(*mb), clip=case["clip"])
    return losses, state_copy(model)


def run_hf_reference(name: str) -> tuple[list[float], dict]:
    model = hf_model(name)
    steps = [[b] for b in global_batches(model.config.vocab_size, SEQ)]
    losses = reference_train(model, reference_optimizer(HF_OPTIMIZER[name], model.parameters()), steps,
                             loss_fn=hf_loss, clip=1.0)
    return losses, state_copy(model)


# -- the ranks ----------------------------------------------------------------------------------------------

def _train(model: nn.Module, config: dict, tp: int, batches, micro_fn, loss_fn, ckpt_dir: str) -> dict:
    import shardwise
    from shardwise.parallel.tensor_parallel import gather_full_state_dict
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, dp_rank = world // tp, rank // tp                      # tp innermost: ranks [d*tp, (d+1)*tp) share data
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    gas = engine.gradient_accumulation_steps()
    losses, norms = [], []
    for b in batches:
        total = 0.0
        for mb in shard_global_batch(b, dp_size=dp, dp_rank=dp_rank, grad_accum=gas):
            loss = loss_fn(engine, micro_fn(mb))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        losses.append(mean_over_ranks(total / gas))           # TP peers hold equal losses: world mean = dp mean
        norms.append(engine.updater.last_grad_norm)
    last = engine.global_steps - 1
    out = {"losses": losses, "norms": norms, "report": engine.comm_report(),
           "tp_traffic": Counter((r.op, r.nbytes) for r in engine.ledger.records
                                 if r.group == "tp" and r.step == last),
           "local_params": sum(p.numel() for p in engine.module.parameters())}
    tp_comm = next(m.comm for m in engine.module.modules() if hasattr(m, "comm"))
    out["state"] = gather_full_state_dict(engine.module, tp_comm)    # collective: after the traffic snapshot
    # Stage 0 under TP: each TP rank's slices and optimizer state in its own mp_rank_TT file; wiping the
    # weights and loading them back gives the same full model.
    engine.save_checkpoint(ckpt_dir, tag="end")
    with torch.no_grad():
        for p in engine.module.parameters():
            p.zero_()
    engine.load_checkpoint(ckpt_dir)
    out["reloaded"] = gather_full_state_dict(engine.module, tp_comm)
    engine.close()
    return out


def _all_cases(gpt_names: list[str], hf: list[str], root: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name in gpt_names:
        case = GPT_CASES[name]
        config = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": case["gas"],
                  "gradient_clipping": case["clip"], "optimizer": case["optimizer"],
                  "zero_optimization": {"stage": 0, "reduce_bucket_size": 4000},
                  "tensor_parallel": {"size": case["tp"], "sequence_parallel": case["sp"]}}
        out[name] = _train(gpt(case), config, case["tp"], global_batches(256, SEQ + 1), lm_pair,
                           lambda engine, mb: engine(mb), f"{root}/{name}")
    for name in hf:
        config = {"train_batch_size": GLOBAL_BATCH, "gradient_clipping": 1.0, "optimizer": HF_OPTIMIZER[name],
                  "tensor_parallel": {"autotp_size": 2}}
        model = hf_model(name)
        out[name] = _train(model, config, 2, global_batches(model.config.vocab_size, SEQ), lambda mb: mb, hf_loss,
                           f"{root}/{name}")
    return out


# -- checks -----------------------------------------------------------------------------------------------

def megatron_tp_traffic(case: dict, micro: int) -> Counter:
    """(op, bytes) -> count of one micro-batch's collectives on the TP group, fp32, L = N_LAYER layers.
    Per layer 2 all-reduces of b*s*h forward and 2 backward (Korthikanti et al. 2022, sec. 4.2.2); the embedding
    adds one forward and the lm-head's input one backward. With sequence parallelism each all-reduce is a
    reduce-scatter + all-gather pair, each column-parallel input (attention's q/k/v share one, the MLP's fc_in,
    the lm-head) is all-gathered once more in backward for its weight gradient (only the sequence shard is kept,
    as Megatron-LM does), and every replicated parameter used on sequence shards (norms, row biases) sums its
    gradient once."""
    bsh, L = micro * SEQ * D_MODEL * 4, N_LAYER
    learned = case["gpt"].get("positions", "learned") == "learned"
    bias = case["gpt"].get("bias", True)
    per_norm = 2 if bias and case["gpt"].get("norm", "layernorm") == "layernorm" else 1   # weight (+ bias)
    c: Counter = Counter()
    if not case["sp"]:
        c[("all_reduce", bsh)] += 4 * L + 2
    else:
        c[("all_gather", bsh)] += 4 * L + 2 + (2 * L + 1)      # (the re-gathers for weight gradients)
        c[("reduce_scatter", bsh)] += 4 * L + (1 if learned else 2)
        if learned:                    # tokens + positions all-reduced, then split into sequence shards
            c[("all_reduce", bsh)] += 1
        # ln_1, ln_2 (w, b), o_proj/fc_out bias; final norm (a SwiGLU MLP's gate shares fc_in's re-gather)
        c[("all_reduce", D_MODEL * 4)] += L * (2 * per_norm + 2 * int(bias)) + per_norm
    c[("all_reduce", micro * SEQ * 4)] += 1                  # loss: max logit per token
    c[("all_reduce", 2 * micro * SEQ * 4)] += 1              # loss: sum of exp and target logit per token
    return c


def test_tensor_parallel_training_equals_single_process(tmp_path, one_thread):
    names, hf = list(GPT_CASES), hf_names()
    _check_results(run_distributed(_all_cases, 4, args=(names, hf, str(tmp_path)), timeout=420), names, hf)


def _check_results(results: list[dict], names: list[str], hf: list[str]) -> None:
    for name in names:
        case = GPT_CASES[name]
        ref_losses, ref_state = run_gpt_reference(case)
        micro = GLOBAL_BATCH // (case["gas"] * (4 // case["tp"]))
        expected = megatron_tp_traffic(case, micro)
        expected = Counter({k: v * case["gas"] for k, v in expected.items()})
        for rank, res in enumerate(results):
            got = res[name]
            assert_close_lists(got["losses"], ref_losses, rtol=1e-5, what=f"{name} rank {rank} losses")
            assert_state_close(got["state"], ref_state, what=f"{name} rank {rank}", adam=case["optimizer"] is ADAMW)
            assert got["norms"][0] > case["clip"], f"{name}: clipping never engaged, the TP norm went untested"
            assert got["norms"] == results[0][name]["norms"], f"{name}: ranks disagree on the gradient norm"
            assert got["tp_traffic"] == expected, f"{name} rank {rank}: TP traffic {got['tp_traffic']} != {expected}"
            for k, v in got["state"].items():
                torch.testing.assert_close(got["reloaded"][k], v, rtol=0, atol=0, msg=f"{name}: reloaded {k}")
            report = {(c["op"], c["group"]): c for c in got["report"]}
            # one float64 all-reduce per step: the sliced part of the squared norm and the inf/nan flag (fp32
            # steps with inf/nan gradients are skipped by default)
            assert report[("all_reduce", "tp:metrics")]["count"] == 1
            assert report[("all_reduce", "tp:metrics")]["bytes"] == 16
            if case["tp"] == 2:        # dp = 2: each rank all-reduces its own slice's gradients once per step
                assert report[("all_reduce", "dp")]["bytes"] == 4 * got["local_params"]
            else:
                assert not any(c["group"] == "dp" for c in got["report"]), "dp = 1 must not communicate"
    for name in hf:
        ref_losses, ref_state = run_hf_reference(name)
        for rank, res in enumerate(results):
            got = res[name]
            assert_close_lists(got["losses"], ref_losses, rtol=1e-5, what=f"{name} rank {rank} losses")
            assert_state_close(got["state"], ref_state, what=f"{name} rank {rank}", adam=HF_OPTIMIZER[name] is ADAMW)
