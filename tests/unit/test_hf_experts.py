"""`shard_hf_experts` at ep 1 (one process, the all-to-all exchange over a group of one): a transformers MoE model
(Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, OLMoE) whose experts module dispatches through shardwise gives
transformers' logits, load-balancing loss and gradients with the same weights; a model without a stacked experts
module is refused in one line. The ep-2 checks (forward and 5 training steps) are in
tests/distributed/test_hf_moe.py."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

SEQ, VOCAB = 8, 64


def _model(family: str) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, intermediate_size=24,
                                                                          num_local_experts=4))
    if family == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20,
            num_experts=4))
    if family == "gpt_oss":           # experts with biases, stored transposed and interleaved
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **common, intermediate_size=24, num_local_experts=4, head_dim=4, layer_types=["full_attention"] * 2))
    if family == "olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**common, intermediate_size=24, num_experts=4,
                                                                      eos_token_id=None, pad_token_id=None))
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **common, intermediate_size=24, moe_intermediate_size=12, head_dim=4, num_experts=4, norm_topk_prob=True))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "olmoe"])
def test_ep1_dispatch_equals_transformers(family: str) -> None:
    from shardwise.models.hf_experts import ExpertParallelExperts, hf_experts_modules, shard_hf_experts
    model = _model(family)
    reference = copy.deepcopy(model)
    assert shard_hf_experts(model, None) == 2
    assert all(isinstance(m, ExpertParallelExperts) for m in hf_experts_modules(model))
    assert model.state_dict().keys() == reference.state_dict().keys()
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    ours, theirs = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=0.0)
    ours.loss.backward()
    theirs.loss.backward()
    ref_grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = ref_grads[name].grad
        assert p.grad is not None and grad is not None, name
        torch.testing.assert_close(p.grad, grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="already cut"):
        shard_hf_experts(model, None)


def test_model_without_stacked_experts_is_refused() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.errors import UserError
    from shardwise.models.hf_experts import shard_hf_experts
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                         num_attention_heads=4))
    with pytest.raises(UserError, match="LlamaForCausalLM has no transformers experts module"):
        shard_hf_experts(llama, None)
