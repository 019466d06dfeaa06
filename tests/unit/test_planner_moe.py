"""The planner's mixtures of experts: total and active parameters, FLOPs per token from the active ones, expert
states per rank under ep and ZeRO, the all-to-all bytes and their time, and ep in the search. The figures of a
small model are counted here by hand; the large presets against their papers."""

from __future__ import annotations

import json

import pytest

from shardwise.cli.main import main as cli_main
from shardwise.models.presets import MOE_PRESETS, GPTConfig, gpt_flops_per_token, gpt_num_params
from shardwise.planner import (
    JobSpec, Optimizer, Plan, PlannerError, Precision, Recompute, cluster_preset, flops_per_token, model_name,
    model_preset, param_count,
)
from shardwise.planner.comm import Axis, Op, ep_collectives, expert_all_to_all_bytes, step_collectives
from shardwise.planner.flops import busiest_rank_params
from shardwise.planner.memory import plan_model_states
from shardwise.planner.search import Reason, layout_problems, search
from shardwise.planner.time import step_time

# Block 0 dense, block 1 MoE. d = 8, no biases, RMSNorm, rotary, untied head, vocabulary 16:
#   dense block: q, k, v, o 4 * 8 * 8 = 256; two norms 2 * 8 = 16; GELU MLP 2 * 8 * 16 = 256   -> 528
#   MoE block:   256 + 16; router 8 * 4 = 32; 4 experts of 2 * 8 * 4 = 64 each = 256           -> 560
#   tables: token 16 * 8 = 128, head 128, final norm 8                                          -> 264
SMALL = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=8, d_ff=16, bias=False, positions="rotary",
                  norm="rmsnorm", moe_experts=4, moe_top_k=2, moe_d_ff=4, moe_first_dense=1)
EXPERT = 64
TOTAL = 528 + 560 + 264                      # 1352
ACTIVE = TOTAL - (4 - 2) * EXPERT            # a token runs 2 of the 4 experts: 1224


def test_small_model_counted_by_hand() -> None:
    count = param_count(SMALL)
    assert (count.total, count.active) == (TOTAL, ACTIVE) == (1352, 1224)
    assert count.total == gpt_num_params(SMALL)
    # N of the per-token matmuls: the blocks' active weights (528 + 272 + 32 + 2 * 64) + final norm + head = 1096;
    # 6 N + 6 L s d (causal scores) = 6576 + 768
    assert flops_per_token(SMALL) == 6 * 1096 + 6 * 2 * 8 * 8 == 7344 == gpt_flops_per_token(SMALL)


def test_published_counts_and_the_model_table() -> None:
    mixtral = model_preset("mixtral-8x7b")
    # Jiang et al. 2024 (Mixtral of Experts): 46.7B parameters, 12.9B active per token
    assert param_count(mixtral).total == 46_702_792_704
    assert round(param_count(mixtral).active / 1e9, 1) == 12.9
    # Dai et al. 2024 (DeepSeekMoE): 16.4B total, 2.8B activated
    deepseek = model_preset("deepseek-moe-16b")
    assert round(param_count(deepseek).total / 1e9, 1) == 16.4
    assert round(param_count(deepseek).active / 1e9, 1) == 2.8
    for name, cfg in MOE_PRESETS.items():
        assert model_name(cfg) == name
        assert param_count(cfg).total == gpt_num_params(cfg)
        assert flops_per_token(cfg) == gpt_flops_per_token(cfg)


def test_expert_states_shard_over_the_expert_data_parallel_group() -> None:
    # ep 2 of dp 4: a rank holds 2 of the 4 experts (128) and everything else (1352 - 256 = 1096); the experts'
    # states shard over the dp / ep = 2 ranks holding the same experts, the rest over all 4
    assert busiest_rank_params(SMALL, ep=2) == (1096, 128)
    job = JobSpec(global_batch=8, precision=Precision.BF16, optimizer=Optimizer.ADAM)
    states = plan_model_states(SMALL, job, Plan(dp=4, ep=2, zero_stage=1))
    assert states.weights == states.grads == 2 * 1096 + 2 * 128
    assert states.optimizer == 12 * (1096 // 4) + 12 * (128 // 2)
    zero3 = plan_model_states(SMALL, job, Plan(dp=4, ep=2, zero_stage=3))
    assert zero3.weights == 2 * 274 + 2 * 64 and zero3.optimizer == 12 * 274 + 12 * 64
    # without ep every rank holds every expert, all sharded over the 4 replicas
    assert plan_model_states(SMALL, job, Plan(dp=4, zero_stage=3)).weights == 2 * 338      # 1352 / 4


def test_all_to_all_bytes_follow_the_formula_and_enter_the_step_time() -> None:
    cluster = cluster_preset("a100-80gb", 4)
    job = JobSpec(global_batch=8, precision=Precision.BF16)
    plan = Plan(dp=4, ep=2)                       # 2 micro-batches of 1 sequence of 8 tokens per rank
    (a2a,) = ep_collectives(SMALL, cluster, job, plan)
    assert (a2a.axis, a2a.op, a2a.group_size) == (Axis.EP, Op.ALL_TO_ALL, 2)
    tokens, k, h, e = 8, 2, 8, 2
    assert a2a.payload_bytes == tokens * k * h * e == 256                 # the ledger's input of one all-to-all
    # dispatch and combine, forward and backward, in the one MoE block, for each of the 2 micro-batches
    assert a2a.calls == 2 * 2 * 1 * 2
    assert a2a.sent_bytes == a2a.calls * expert_all_to_all_bytes(SMALL, tokens=8, ep=2, nbytes=2) == 8 * 128
    recomputed = ep_collectives(SMALL, cluster, job, plan.replace(recompute=Recompute.FULL))[0]
    assert recomputed.calls == 3 * 2 * 2           # the recomputed forward dispatches and combines again
    t = step_time(SMALL, cluster, job, plan)
    assert t.ep_comm_s == pytest.approx(a2a.total_seconds) and t.ep_comm_s > 0
    assert t.total_s == pytest.approx(t.compute_s + t.ep_comm_s + t.dp_exposed_s + t.optimizer_s)
    assert not ep_collectives(SMALL, cluster, job, Plan(dp=4))
    # the experts' gradients are reduced over their own group
    dp = [c for c in step_collectives(SMALL, cluster, job, plan) if c.axis is Axis.DP]
    assert sorted((c.purpose, c.group_size, c.payload_bytes) for c in dp) == [
        ("experts: gradients", 2, 128 * 2), ("gradients", 4, 1096 * 2)]


def test_search_enumerates_ep_dividing_dp_and_the_experts() -> None:
    cluster = cluster_preset("a100-80gb", 8)
    job = JobSpec(global_batch=16, precision=Precision.BF16)
    result = search(SMALL, cluster, job)
    eps = {e.plan.ep for e in result.ranked}
    assert eps == {1, 2, 4}                        # 8 does not divide the 4 experts
    assert all(e.plan.dp % e.plan.ep == 0 for e in result.ranked)
    assert any(p.reason is Reason.EP_EXPERTS for p in layout_problems(SMALL, cluster, job, Plan(dp=8, ep=8)))
    dense = model_preset("tiny")
    (problem,) = [p for p in layout_problems(dense, cluster, job, Plan(dp=8, ep=2)) if p.reason is Reason.EP_EXPERTS]
    assert "dense model has no experts" in problem.detail
    assert {e.plan.ep for e in search(dense, cluster, job).ranked} == {1}
    with pytest.raises(PlannerError, match=r"plan.ep = 2 does not divide dp = 3"):
        Plan(dp=3, ep=2)


def test_plan_command_recommends_expert_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--model", "deepseek-moe-16b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["plan"]["ep"] > 1
    assert out["model"]["params_active"] == param_count(model_preset("deepseek-moe-16b")).active
    assert cli_main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--seq", "4096", "--dp", "32", "--tp", "2",
                     "--ep", "4", "--zero", "1", "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)["plan"]
    assert evaluated["plan"]["ep"] == 4 and evaluated["step_time"]["ep_comm_s"] > 0


def test_a_plan_with_ep_is_not_written_as_a_config_that_drops_it(tmp_path) -> None:
    from shardwise.planner.export import write_config
    job = JobSpec(global_batch=8, precision=Precision.BF16)
    with pytest.raises(PlannerError, match=r"plan.ep = 2: the config has no expert-parallel size"):
        write_config(tmp_path / "c.json", Plan(dp=4, ep=2), job)
    assert not (tmp_path / "c.json").exists()
    assert write_config(tmp_path / "c.json", Plan(dp=4), job)["train_batch_size"] == 8


# mistralai/Mixtral-8x7B-v0.1's config.json (the keys the planner reads, and some it ignores)
MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000}


def test_a_mixtral_config_json_is_the_mixtral_preset() -> None:
    from shardwise.planner.hf import model_from_hf_config
    model = model_from_hf_config(MIXTRAL_CONFIG)
    assert model_name(model) == "mixtral-8x7b" and model == model_preset("mixtral-8x7b")
    small = model_from_hf_config({**MIXTRAL_CONFIG, "num_local_experts": 4, "num_experts_per_tok": 1})
    assert (small.moe_experts, small.moe_top_k) == (4, 1) and model_name(small) == "custom"
    with pytest.raises(PlannerError, match=r"moe_top_k=5 with moe_experts=4"):
        model_from_hf_config({**MIXTRAL_CONFIG, "num_local_experts": 4, "num_experts_per_tok": 5})
