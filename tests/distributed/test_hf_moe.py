"""Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE, gpt-oss with
expert biases) from tiny configs, their experts cut for expert parallelism by `shard_hf_experts` (the model's
source untouched):

- at ep 2 the logits (and transformers' router aux loss) of each rank's batch equal the whole model's;
- 5 training steps at ep 2 (2 ranks, stage 0 and ZeRO 1-3) equal the single-process model (fp32, rtol 1e-5):
  losses with transformers' load-balancing loss (`output_router_logits`, `router_aux_loss_coef`), each rank's dense
  weights and its experts against the reference's same experts. The reference runs the 2 ranks' shards as 2
  micro-batches of one step (the aux loss is not linear in the tokens: one big batch would differ).

Every case runs in one launch of 2 ranks; ep 1 (the same exchange with a group of one) is in
tests/unit/test_hf_experts.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import (
    assert_close_lists, assert_state_close, reference_train, run_distributed, shard_global_batch, state_copy,
    token_batches,
)

pytest.importorskip("transformers")

STEPS, WORLD, SEQ, VOCAB = 5, 2, 8, 64
_SGD = {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}}
# name -> (model family, zero_optimization, optimizer, clip)
CASES: dict[str, tuple[str, dict, dict, float]] = {
    "mixtral_zero0_sgd_clip": ("mixtral", {"stage": 0}, _SGD, 0.05),
    "qwen2_moe_zero2_adam": ("qwen2_moe", {"stage": 2},
                             {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}}, 0.0),
    # every parameter sharded: the stacked experts in flats of their own over the expert-dp group
    "qwen3_moe_zero3_sgd": ("qwen3_moe", {"stage": 3, "stage3_param_persistence_threshold": 0}, _SGD, 0.0),
    # experts with biases [E, ...], stored transposed: every stacked parameter is cut by expert
    "gpt_oss_zero1_sgd_clip": ("gpt_oss", {"stage": 1}, _SGD, 0.05),
}


def hf_moe(family: str) -> torch.nn.Module:
    """A tiny transformers MoE model: 4 experts, top-2, the router's aux loss in the training loss."""
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=0.05)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, intermediate_size=24,
                                                                          num_local_experts=4))
    if family == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20,
            num_experts=4, norm_topk_prob=False))
    if family == "gpt_oss":
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **common, intermediate_size=24, num_local_experts=4, head_dim=4, layer_types=["full_attention"] * 2))
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **common, intermediate_size=24, moe_intermediate_size=12, head_dim=4, num_experts=4, norm_topk_prob=True))


def _local_experts(state: dict, first: int, local: int) -> dict:
    """The reference's state with each stacked expert weight [E, ...] cut to this rank's experts."""
    return {k: (v[first:first + local] if ".experts." in k else v) for k, v in state.items()}


def _case(family: str, zero: dict, optimizer: dict, clip: float) -> dict:
    import shardwise
    from shardwise.models.hf_experts import hf_experts_modules, shard_hf_experts
    from shardwise.parallel.experts import build_expert_groups
    world, rank = dist.get_world_size(), dist.get_rank()
    model = hf_moe(family)
    reference = copy.deepcopy(model)
    changed = shard_hf_experts(model, build_expert_groups(WORLD))
    experts = next(hf_experts_modules(model))
    first, local = experts.first_expert, experts.num_experts

    # Forward at ep 2 against the whole model, on this rank's own tokens (its routing differs from the peer's).
    probe = token_batches(1, 2 * world, SEQ, seed=11, vocab=VOCAB)[0][2 * rank:2 * rank + 2]
    with torch.no_grad():
        ours, theirs = model(input_ids=probe, labels=probe), reference(input_ids=probe, labels=probe)
    forward = (ours.logits, theirs.logits, ours.aux_loss, theirs.aux_loss)

    config = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "optimizer": optimizer,
              "gradient_clipping": clip, "zero_optimization": {**zero, "reduce_bucket_size": 2000},
              "steps_per_print": 10_000}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    batches = token_batches(STEPS, 2 * world, SEQ, seed=3, vocab=VOCAB)
    losses = []
    for batch in batches:
        (mine,) = shard_global_batch(batch, dp_size=world, dp_rank=rank, grad_accum=1)
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    a2a = sorted({(r["group"], r["group_size"]) for r in engine.comm_report() if r["op"] == "all_to_all"})
    state = {k: v.detach().clone() for k, v in engine.dp_runtime.gathered_state_dict(model, rank0_only=False).items()}
    engine.close()

    opt_cls = torch.optim.SGD if optimizer["type"] == "SGD" else torch.optim.AdamW
    ref_opt = opt_cls(reference.parameters(), **{k: v for k, v in optimizer["params"].items() if k != "torch_adam"})
    ref_losses = reference_train(reference, ref_opt, [shard_global_batch(b, dp_size=1, dp_rank=0, grad_accum=world)
                                                      for b in batches],
                                 loss_fn=lambda m, mb: m(input_ids=mb, labels=mb).loss, clip=clip)
    return {"forward": forward, "losses": losses, "ref_losses": ref_losses, "state": state, "a2a": a2a,
            "changed": changed, "ref_state": _local_experts(state_copy(reference), first, local)}


def _all_cases(cases: dict) -> dict:
    torch.set_num_threads(1)
    return {name: _case(*case) for name, case in cases.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_all_cases, WORLD, args=(CASES,), timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_hf_moe_at_ep2_equals_transformers(results: list[dict], name: str) -> None:
    adam = CASES[name][2]["type"] != "SGD"
    for rank, res in enumerate(results):
        case = res[name]
        ours, theirs, our_aux, their_aux = case["forward"]
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} rank {rank}: {m}")
        torch.testing.assert_close(our_aux, their_aux, rtol=1e-5, atol=0.0)
        assert case["changed"] == 2, case["changed"]                 # one experts module per layer
        assert_close_lists(case["losses"], case["ref_losses"], rtol=1e-5, what=f"{name} rank {rank} losses")
        assert_state_close(case["state"], case["ref_state"], what=f"{name} rank {rank}", adam=adam)
        assert case["a2a"] == [("ep:ep_size_2", 2)], case["a2a"]    # the exchanges are in the engine's ledger
