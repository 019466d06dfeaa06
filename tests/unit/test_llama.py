"""Our Llama-style model (RMSNorm, SwiGLU, rotary, grouped-query attention) and our GPT against transformers'
LlamaForCausalLM / GPT2LMHeadModel holding the same weights: equal logits in fp32. The weight mapping is the one
`shardwise export --to hf` writes, so these tests also check the export's names and layouts."""

from __future__ import annotations

import pytest
import torch

from shardwise.models import GPT, gpt_config, gpt_num_params
from shardwise.models.hf import from_hf_state_dict, hf_config, hf_family, to_hf_state_dict

pytest.importorskip("transformers")

SEQ = 24


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, SEQ), generator=torch.Generator().manual_seed(5))


def _hf_twin(model: GPT) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_config(hf_config(model.cfg), attn_implementation="eager")
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.cfg, model.state_dict()), strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"} and (not missing or model.cfg.tie_embeddings), missing
    return hf.eval()


@pytest.mark.parametrize("overrides", [
    dict(),                                                  # llama-tiny: 6 query heads share 2 kv heads
    dict(n_kv_head=6, tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-6),
])
def test_llama_logits_equal_transformers(overrides: dict) -> None:
    torch.manual_seed(0)
    model = GPT(gpt_config("llama-tiny", n_layer=2, seq_len=SEQ, **overrides)).eval()
    assert hf_family(model.cfg) == "llama"
    hf = _hf_twin(model)
    ids = _ids(model.cfg.vocab_size)
    with torch.no_grad():
        ours, theirs = model(ids), hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in hf.parameters()) == gpt_num_params(model.cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_gpt_logits_equal_gpt2(tie: bool) -> None:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_layer=2, seq_len=SEQ, tie_embeddings=tie)).eval()
    hf = _hf_twin(model)
    ids = _ids(256)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_hf_names_round_trip(name: str) -> None:
    torch.manual_seed(0)
    model = GPT(gpt_config(name, n_layer=2))
    state = model.state_dict()
    back = from_hf_state_dict(model.cfg, to_hf_state_dict(model.cfg, state))
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(back[k], v), k


def test_shapes_without_a_counterpart_are_refused() -> None:
    from shardwise.errors import UserError
    with pytest.raises(UserError, match="no Hugging Face counterpart.*--to safetensors"):
        hf_family(gpt_config("tiny", positions="rotary"))


def test_swiglu_width_follows_llama_rule() -> None:
    assert gpt_config("llama-tiny").d_ff == 512             # round_up(8 * 192 / 3, 256)
    assert gpt_config("llama-7b").d_ff == 11008 and gpt_num_params(gpt_config("llama-7b")) == 6_738_415_616
