"""Tensor-parallel plans without processes: pattern resolution, styles, validation messages, the GPT and
Hugging Face plans, head-count adjustment, and a T = 1 application that must leave the model's function
unchanged. (Splitting at T > 1 is tested on gloo ranks in tests/distributed/test_tp_*.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm.ledger import CommLedger
from shardwise.models.parallelize import (
    _adjust_head_counts, gpt_tp_plan, hf_tp_plan, parallelize_gpt, translate_hf_plan, validate_gpt, validate_hf,
)
from shardwise.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, Style, TensorParallelError, VocabParallelEmbedding, apply_tensor_parallel,
    resolve_plan, vocab_parallel_cross_entropy,
)
from shardwise.parallel.tensor_parallel.plan import check_plan
from shardwise.testing import tiny_gpt
from shardwise.comm.topology import SoloComm


def solo() -> SoloComm:
    return SoloComm(None, CommLedger(), name="tp")


class _SizedComm:
    """Only a size: validation must fail before any communication is attempted."""
    size, rank = 4, 0


# -- patterns -------------------------------------------------------------------------------------------

NAMES = ["embed", "embed.tok", "blocks", "blocks.0", "blocks.0.attn", "blocks.0.attn.q_proj", "blocks.1",
         "blocks.1.attn", "blocks.1.attn.q_proj", "blocks.10.attn.q_proj", "head.lm_head"]


def test_star_matches_exactly_one_component_and_the_whole_name():
    got = resolve_plan(NAMES, {"blocks.*.attn.q_proj": "colwise", "blocks.*.attn": "region"})
    assert got == {"blocks.0.attn": Style.REGION, "blocks.0.attn.q_proj": Style.COLWISE,
                   "blocks.1.attn": Style.REGION, "blocks.1.attn.q_proj": Style.COLWISE,
                   "blocks.10.attn.q_proj": Style.COLWISE}
    assert resolve_plan(NAMES, {"*.q_proj": "colwise"}, strict=False) == {}     # * is one component, not many


def test_plan_errors_name_the_entry_and_the_fix():
    with pytest.raises(TensorParallelError, match=r'"blocks\.\*\.attn\.qproj" \(did you mean '
                                                  r'"blocks\.\*\.attn\.q_proj"\?\)'):
        resolve_plan(NAMES, {"blocks.*.attn.qproj": "colwise"})
    with pytest.raises(TensorParallelError, match=r"unknown style 'colwize'; valid styles are \"colwise\""):
        resolve_plan(NAMES, {"head.lm_head": "colwize"})
    with pytest.raises(TensorParallelError, match='matched by plan entries "blocks.0.attn.q_proj" .* and '
                                                  '"blocks.\\*.attn.q_proj"'):
        resolve_plan(NAMES, {"blocks.0.attn.q_proj": "colwise", "blocks.*.attn.q_proj": "rowwise"})


def test_divisibility_and_type_problems_say_which_and_by_how_much():
    model = nn.ModuleDict({"up": nn.Linear(6, 10), "down": nn.Linear(10, 6), "emb": nn.Embedding(50, 6),
                           "norm": nn.LayerNorm(6)})
    problems = check_plan(model, {"up": Style.COLWISE, "down": Style.ROWWISE, "emb": Style.VOCAB,
                                  "norm": Style.COLWISE}, tp=4)
    assert problems == [
        'up ("colwise"): out_features = 10 is not divisible by tensor_parallel.size = 4 (10 = 4 * 2 + 2, 2 left '
        'over); each rank holds out_features / size output features',
        'down ("rowwise"): in_features = 10 is not divisible by tensor_parallel.size = 4 (10 = 4 * 2 + 2, 2 left '
        'over); each rank holds in_features / size input features',
        'emb ("vocab"): num_embeddings (vocabulary) = 50 is not divisible by tensor_parallel.size = 4 (50 = 4 * 12 '
        '+ 2, 2 left over); pad the vocabulary to a multiple of the size',
        'norm ("colwise"): column/row-parallel styles apply to nn.Linear, got LayerNorm',
    ]
    assert check_plan(model, {"emb": Style.ROWWISE}, tp=5) == []      # "rowwise" on an embedding = "vocab"


# -- the GPT --------------------------------------------------------------------------------------------

def test_gpt_problems_name_heads_kv_heads_hidden_ffn_and_vocab():
    from shardwise.models import gpt_config
    cfg = gpt_config("tiny", n_layer=1, d_model=42, n_head=6, n_kv_head=3, d_ff=102, vocab_size=250)
    problems = validate_gpt(cfg, 4)
    assert [p.split(" = ")[0] for p in problems] == [
        "n_head (attention heads)", "n_kv_head (key/value heads)", "d_model (hidden size)", "d_ff (FFN size)",
        "vocab_size"]
    assert problems[0] == ("n_head (attention heads) = 6 is not divisible by tensor_parallel.size = 4 "
                           "(6 = 4 * 1 + 2, 2 left over); each rank computes whole attention heads; use a "
                           "tensor_parallel.size dividing 6 (1, 2, 3, 6) or change the model")
    assert validate_gpt(cfg, 1) == [] and validate_gpt(gpt_config("tiny", n_head=4, d_model=32), 4) == []
    with pytest.raises(TensorParallelError, match=r"tensor_parallel.size = 4 cannot split this GPT:\n  - n_head"):
        parallelize_gpt(tiny_gpt(seed=0, n_head=2), _SizedComm())


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_every_gpt_plan_entry_matches_the_model(sequence_parallel: bool, positions: str):
    model = tiny_gpt(seed=0, positions=positions)
    plan = gpt_tp_plan(sequence_parallel, learned_positions=positions == "learned")
    styles = resolve_plan((n for n, _ in model.named_modules()), plan)          # strict: nothing unmatched
    assert styles["blocks.1.attn.q_proj"] is Style.COLWISE
    assert styles["blocks.1.mlp.fc_out"] is (Style.ROWWISE_SP if sequence_parallel else Style.ROWWISE)
    assert styles["head.lm_head"] is (Style.COLWISE_SP if sequence_parallel else Style.COLWISE)
    assert ("blocks.0.ln_1" in styles) == sequence_parallel
    assert check_plan(model, styles, tp=4) == []


@pytest.mark.parametrize("tie", [False, True])
def test_tp1_application_keeps_the_function_and_the_ties(tie: bool):
    model = tiny_gpt(seed=0, tie_embeddings=tie)
    ids = torch.randint(0, 256, (2, 16))
    before_logits, before_loss = model(ids).detach(), model(ids, ids).detach()
    old = list(model.parameters())
    info = parallelize_gpt(model, solo())
    assert isinstance(model.blocks[0].attn.q_proj, ColumnParallelLinear)
    assert isinstance(model.blocks[0].mlp.fc_out, RowParallelLinear)
    assert isinstance(model.embed.tok, VocabParallelEmbedding)
    assert (model.head.lm_head.weight is model.embed.tok.weight) == tie
    torch.testing.assert_close(model(ids), before_logits, rtol=0, atol=0)
    torch.testing.assert_close(model(ids, ids), before_loss, rtol=1e-6, atol=1e-6)
    new = info.remap(old)
    assert {id(p) for p in new} == {id(p) for p in model.parameters()}
    groups = info.remap([{"params": old[:3], "lr": 0.1}])
    assert groups[0]["lr"] == 0.1 and groups[0]["params"][0] is model.embed.tok.weight


def test_vocab_parallel_loss_at_one_rank_is_torch_cross_entropy():
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 11) * 4).requires_grad_(True)
    labels = torch.randint(0, 11, (3, 5))
    labels[0, :2] = -100
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.reshape(-1, 11), labels.reshape(-1))
    ref.backward()
    loss = vocab_parallel_cross_entropy(logits, labels, solo())
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="must agree on every dimension but the last"):
        vocab_parallel_cross_entropy(logits, labels[:, :4], solo())


# -- Hugging Face plans ---------------------------------------------------------------------------------

class _Config:
    base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                          "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                          "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
                          "layers.*.mlp.down_proj": "rowwise", "layers.*.mlp.gate_up_proj": "colwise"}
    num_attention_heads, num_key_value_heads, hidden_size, intermediate_size, vocab_size = 4, 2, 16, 32, 64


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.hidden_size, self.head_dim = 4, 2, 16, 4
        self.num_key_value_groups = 2
        self.q_proj, self.k_proj = nn.Linear(16, 16, bias=False), nn.Linear(16, 8, bias=False)
        self.v_proj, self.o_proj = nn.Linear(16, 8, bias=False), nn.Linear(16, 16, bias=False)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = _Attention()
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)
        self.mlp.down_proj = nn.Linear(32, 16, bias=False)


class _ForCausalLM(nn.Module):
    base_model_prefix = "model"
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self):
        super().__init__()
        self.config = _Config()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(64, 16)
        self.model.layers = nn.ModuleList([_Layer(), _Layer()])
        self.lm_head = nn.Linear(16, 64, bias=False)


def test_hf_plan_is_resolved_and_translated_as_transformers_does():
    model = _ForCausalLM()
    plan = hf_tp_plan(model)
    assert list(plan)[0] == "model.embed_tokens" and plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise" and plan["lm_head"] == "colwise_gather_output"
    ours = translate_hf_plan(model, plan)
    assert ours["model.embed_tokens"] is Style.VOCAB and ours["lm_head"] is Style.COLWISE_REP
    assert ours["model.layers.*.mlp.down_proj"] is Style.ROWWISE
    # "gate_up_proj" (fused variants) matches nothing in this model: dropped, as transformers does
    styles = resolve_plan((n for n, _ in model.named_modules()), ours, strict=False)
    assert "model.layers.1.mlp.up_proj" in styles and not any("gate_up" in n for n in styles)
    assert translate_hf_plan(model, {"lm_head": "replicate", "model.layers.*.mlp": "rowwise_split_input"}) == {
        "model.layers.*.mlp": Style.ROWWISE_REP}


def test_hf_plan_problems_are_errors():
    model = _ForCausalLM()
    with pytest.raises(TensorParallelError, match='"model.layers.\\*.mlp.experts": style "moe_tp_experts" is not '
                                                  'supported'):
        translate_hf_plan(model, {"model.layers.*.mlp.experts": "moe_tp_experts"})
    with pytest.raises(TensorParallelError, match="name a parameter rather than a module"):
        translate_hf_plan(model, {"model.layers.*.self_attn.q_proj.weight": "colwise"})
    assert [p.split(" = ")[0] for p in validate_hf(_Config(), 4)] == ["num_key_value_heads"]
    assert validate_hf(_Config(), 2) == []


def test_attention_head_counts_become_per_rank():
    model = _ForCausalLM()
    styles = resolve_plan((n for n, _ in model.named_modules()), translate_hf_plan(model, hf_tp_plan(model)),
                          strict=False)
    _adjust_head_counts(model, styles, 2)
    attn = model.model.layers[1].self_attn
    assert (attn.num_heads, attn.num_key_value_heads, attn.hidden_size) == (2, 1, 8)
    assert (attn.head_dim, attn.num_key_value_groups) == (4, 2)          # per-head quantities are unchanged


def test_hf_model_at_tp1_is_unchanged_in_function():
    model = _ForCausalLM()
    from shardwise.models.parallelize import parallelize_hf
    x = torch.randn(2, 3, 16)
    before = model.lm_head(x).detach()
    parallelize_hf(model, solo())
    assert isinstance(model.lm_head, ColumnParallelLinear) and model.lm_head.gather_output
    assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
    torch.testing.assert_close(model.lm_head(x), before, rtol=0, atol=0)


def test_tied_parameters_split_differently_are_refused():
    model = nn.ModuleDict({"emb": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False)})
    model["head"].weight = model["emb"].weight
    with pytest.raises(TensorParallelError, match="tied parameters .* are split differently"):
        apply_tensor_parallel(model, solo(), {"head": "colwise"})
