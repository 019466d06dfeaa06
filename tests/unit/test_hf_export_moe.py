"""Our MoE GPT in the Llama shape against transformers' MixtralForCausalLM holding the exported weights (the
mapping `shardwise export --to hf` writes): equal logits in fp32, with and without shared experts (folded into
every routed expert), also after `save_pretrained` / `from_pretrained`; the names round-trip; a model Mixtral
cannot compute (GELU experts, top-1, token dropping, dense first blocks, sigmoid scores) is refused in one line."""

from __future__ import annotations

import pytest
import torch

from shardwise.errors import UserError
from shardwise.models import GPT, gpt_config
from shardwise.models.hf import from_hf_state_dict, hf_config, hf_family, to_hf_state_dict

pytest.importorskip("transformers")

SEQ = 16


def _tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    args = dict(n_layer=2, d_model=32, n_head=4, n_kv_head=2, seq_len=SEQ, moe_d_ff=24)
    return GPT(gpt_config("llama-moe-tiny", **{**args, **overrides})).eval()


@pytest.mark.parametrize("overrides", [
    dict(),                                                     # the preset: 4 experts, top-2, one shared expert
    dict(moe_shared_experts=0, moe_top_k=3, rope_theta=1e6, tie_embeddings=True),
])
def test_moe_logits_equal_mixtral(overrides: dict, tmp_path) -> None:
    from transformers import AutoModelForCausalLM
    model = _tiny(**overrides)
    assert hf_family(model.cfg) == "mixtral"
    hf = AutoModelForCausalLM.from_config(hf_config(model.cfg))
    assert type(hf).__name__ == "MixtralForCausalLM"
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.cfg, model.state_dict()), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if model.cfg.tie_embeddings else set()), missing
    hf.save_pretrained(str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (3, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = model(ids)
        torch.testing.assert_close(hf.eval()(input_ids=ids).logits, ours, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loaded(input_ids=ids).logits, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_names_round_trip(shared: int) -> None:
    model = _tiny(moe_shared_experts=shared)
    state = model.state_dict()
    back = from_hf_state_dict(model.cfg, to_hf_state_dict(model.cfg, state))
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("name, overrides, match", [
    ("gpt-moe-tiny", {}, "experts are mlp=gelu .* Mixtral's are SwiGLU"),
    ("llama-moe-tiny", {"moe_top_k": 1}, "moe_top_k=1"),
    ("llama-moe-tiny", {"moe_capacity_factor": 1.0}, "moe_capacity_factor=1.0 drops tokens"),
    ("llama-moe-tiny", {"moe_first_dense": 1}, "moe_first_dense=1"),
    ("llama-moe-tiny", {"moe_score": "sigmoid"}, "moe_score=sigmoid"),
])
def test_moe_without_a_counterpart_is_refused(name: str, overrides: dict, match: str) -> None:
    with pytest.raises(UserError, match=f"no Hugging Face counterpart: .*{match}.*--to safetensors") as e:
        hf_family(gpt_config(name, **overrides))
    assert "\n" not in str(e.value)


def test_export_refuses_gelu_experts_before_reading_weights(capsys, tmp_path) -> None:
    from shardwise.cli.main import main
    (tmp_path / "run").mkdir()                  # no checkpoint in it: the refusal comes before any weight is read
    assert main(["export", str(tmp_path / "run"), "--model", "gpt-moe-tiny", "--to", "hf", "--out",
                 str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "experts are mlp=gelu" in err and "--to safetensors" in err, err
    assert not (tmp_path / "hf").exists()
