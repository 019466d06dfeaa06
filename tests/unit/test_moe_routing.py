"""The MoE layer on one process: the routing rule (top-k, capacity and its drop policies, DeepSpeed's losses),
the dispatch against a dense per-token loop, the presets' counts, and bad input as one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.errors import UserError
from shardwise.models import GPT, gpt_config, gpt_num_params
from shardwise.models.presets import MOE_PRESETS, gpt_flops_per_token
from shardwise.parallel.experts import (
    BalanceCount, DropPolicy, MoEConfig, MoELayer, NoisyGate, ScoreFunction, expert_layout,
)
from shardwise.parallel.experts.config import check_expert_split
from shardwise.parallel.experts.router import route


def _expert(h: int) -> nn.Module:
    return nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))


def _dense_reference(layer: MoELayer, tokens: torch.Tensor) -> torch.Tensor:
    """sum over kept choices of weight * expert(token), one token at a time."""
    r = layer.routing
    assert r is not None
    out = torch.zeros_like(tokens)
    for s in range(tokens.shape[0]):
        for j in range(r.expert.shape[1]):
            if r.kept[s, j]:
                out[s] += r.weight[s, j] * layer.local_experts()[int(r.expert[s, j])](tokens[s:s + 1])[0]
    return out


@pytest.mark.parametrize("k, score, drop", [(1, ScoreFunction.SOFTMAX, False), (2, ScoreFunction.SOFTMAX, True),
                                            (3, ScoreFunction.SIGMOID, True)])
def test_dispatch_equals_a_per_token_loop(k: int, score: ScoreFunction, drop: bool) -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=k, score=score, drop_tokens=drop, capacity_factor=0.5, min_capacity=0)
    layer = MoELayer(8, cfg, make_expert=lambda: _expert(8))
    x = torch.randn(3, 7, 8, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y.reshape(-1, 8), _dense_reference(layer, x.detach().reshape(-1, 8)),
                               rtol=1.3e-6, atol=1e-6)
    assert layer.routing is not None and bool(layer.routing.kept.all()) == (not drop)
    y.square().sum().backward()               # gradients reach the input, every expert that got a token, the gate
    assert x.grad is not None and layer.gate.wg.weight.grad is not None


def test_position_policy_keeps_first_choices_first() -> None:
    # 4 tokens, 2 experts, k = 2, capacity max(ceil(4 / 2 * 0.5 * 2), 0) = 2 per expert. Every token's first
    # choice is expert 0 (larger logit), second expert 1: expert 0 keeps tokens 0 and 1 as first choices, expert 1
    # keeps tokens 0 and 1 as second choices.
    logits = torch.tensor([[2.0, 0.0], [3.0, 1.0], [1.0, 0.5], [4.0, 0.0]])
    cfg = MoEConfig(num_experts=2, top_k=2, capacity_factor=0.5, min_capacity=0, drop_policy=DropPolicy.POSITION)
    r = route(logits, cfg, training=True)
    assert r.expert.tolist() == [[0, 1]] * 4
    assert r.kept.tolist() == [[True, True], [True, True], [False, False], [False, False]]
    assert r.counts.tolist() == [4, 4]          # before capacity (DeepSpeed's exp_counts)
    assert r.weight[2:].abs().sum() == 0        # a token whose every choice was dropped contributes nothing


def test_probability_policy_keeps_the_highest_scores() -> None:
    logits = torch.tensor([[0.0, -9.0], [3.0, -9.0], [1.0, -9.0]])       # all to expert 0; capacity 1
    cfg = MoEConfig(num_experts=2, top_k=1, capacity_factor=0.5, min_capacity=1, drop_policy=DropPolicy.PROBABILITY)
    assert route(logits, cfg, training=True).kept[:, 0].tolist() == [False, True, False]


def test_losses_are_deepspeeds() -> None:
    torch.manual_seed(1)
    logits = torch.randn(10, 4)
    gates = logits.softmax(-1)
    first = torch.nn.functional.one_hot(gates.argmax(-1), 4).float()
    r = route(logits, MoEConfig(num_experts=4, top_k=1, drop_tokens=False), training=True)
    torch.testing.assert_close(r.aux_loss, (gates.mean(0) * first.mean(0)).sum() * 4)        # top-1: sum(me*ce)*E
    torch.testing.assert_close(r.z_loss, torch.logsumexp(logits, -1).square().mean())
    top3 = torch.zeros(10, 4).scatter_(1, gates.topk(3, -1).indices, 1.0)
    r3 = route(logits, MoEConfig(num_experts=4, top_k=3, drop_tokens=False,
                                 balance_count=BalanceCount.ALL_CHOICES), training=True)
    torch.testing.assert_close(r3.aux_loss, (gates.mean(0) * top3.mean(0)).mean() * 4 * 4 / 3)   # DeepSpeed's top-k
    torch.testing.assert_close(r3.weight.sum(-1), torch.ones(10))     # renormalised over the kept top-k


def test_presets_count_experts_and_flops_count_the_active_ones() -> None:
    assert gpt_num_params(MOE_PRESETS["mixtral-8x7b"]) == 46_702_792_704        # Mixtral 8x7B as published
    assert round(gpt_num_params(MOE_PRESETS["deepseek-moe-16b"]) / 1e9, 1) == 16.4
    for name in ("gpt-moe-tiny", "llama-moe-tiny"):
        cfg = MOE_PRESETS[name]
        model = GPT(cfg)
        assert model.num_params() == gpt_num_params(cfg)
        dense = gpt_config(name, moe_experts=cfg.moe_top_k)      # the same model with only k experts
        assert gpt_flops_per_token(cfg) == gpt_flops_per_token(dense) + 6 * cfg.d_model * (cfg.moe_experts -
                                                                                           cfg.moe_top_k) * cfg.n_layer
    with torch.device("meta"):
        big = GPT(MOE_PRESETS["deepseek-moe-16b"])
    assert big.num_params() == gpt_num_params(MOE_PRESETS["deepseek-moe-16b"])
    assert not hasattr(big.blocks[0].mlp, "gate") and hasattr(big.blocks[1].mlp, "gate")   # the first is dense


def test_moe_gpt_adds_the_router_losses() -> None:
    torch.manual_seed(0)
    cfg = gpt_config("gpt-moe-tiny", n_layer=2, d_model=32, n_head=4, seq_len=8, moe_d_ff=32,
                     moe_aux_loss_coef=0.5, moe_z_loss_coef=0.25)
    model = GPT(cfg)
    ids = torch.randint(0, 256, (2, 8))
    loss = model(ids, ids)
    layers = [b.mlp for b in model.blocks]
    extra = sum(0.5 * m.routing.aux_loss + 0.25 * m.routing.z_loss for m in layers)
    torch.testing.assert_close(loss, GPT.loss(model(ids), ids) + extra)


@pytest.mark.parametrize("make, words", [
    (lambda: MoEConfig(num_experts=4, top_k=5), ["k = 5", "1 <= k <= num_experts"]),
    (lambda: MoEConfig(num_experts=4, capacity_factor=0.0), ["capacity_factor = 0.0", "> 0"]),
    (lambda: MoEConfig(num_experts=4, eval_capacity_factor=-1.0), ["eval_capacity_factor = -1.0", "> 0"]),
    (lambda: check_expert_split(6, 4), ["num_experts = 6", "ep_size = 4", "dividing 6"]),
    (lambda: expert_layout(range(6), 4), ["ep_size = 4", "6 data-parallel ranks", "dividing 6"]),
])
def test_bad_input_is_one_line_naming_value_and_fix(make, words: list[str]) -> None:
    with pytest.raises(UserError) as e:
        make()
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_deepspeed_moe_refuses_experts_not_divisible_by_ep() -> None:
    from shardwise.moe.layer import MoE
    with pytest.raises(UserError, match="num_experts = 6 is not divisible by ep_size = 4"):
        MoE(8, _expert(8), num_experts=6, ep_size=4)
    with pytest.raises(UserError, match="noisy_gate_policy = 'Gauss'"):
        MoE(8, _expert(8), num_experts=2, noisy_gate_policy="Gauss")


def test_one_host_read_per_layer_and_forward() -> None:
    from shardwise.testing import HostReadCounter
    torch.manual_seed(0)
    cfg = gpt_config("gpt-moe-tiny", n_layer=2, d_model=32, n_head=4, seq_len=8, moe_d_ff=32, moe_capacity_factor=1.0)
    model = GPT(cfg)
    ids = torch.randint(0, 256, (2, 8))
    with HostReadCounter() as reads:
        model(ids, ids).backward()
    assert [f for _, f in reads.calls] == [reads.calls[0][1]] * 2, reads.calls      # the counts, once per layer
    assert reads.calls[0][1].startswith("parallel/experts/dispatch.py")


@pytest.mark.parametrize("noise, policy", [(NoisyGate.JITTER, DropPolicy.RANDOM), (NoisyGate.RSAMPLE, DropPolicy.POSITION)])
def test_noise_and_random_selection_read_nothing_more(noise: NoisyGate, policy: DropPolicy) -> None:
    from shardwise.testing import HostReadCounter
    layer = MoELayer(8, MoEConfig(num_experts=4, top_k=2, noisy_gate=noise, drop_policy=policy,
                                  second_choice_noise=True), make_expert=lambda: _expert(8))
    with HostReadCounter() as reads:
        layer(torch.randn(16, 8)).sum().backward()
    assert len(reads.calls) == 1, reads.calls


def test_pipeline_of_an_moe_gpt_is_refused_in_one_line() -> None:
    model = GPT(gpt_config("gpt-moe-tiny", n_layer=2, d_model=32, n_head=4, seq_len=8, moe_d_ff=32))
    with pytest.raises(UserError, match="pipeline parallelism of an MoE model .*use pipeline.stages = 1"):
        model.pipeline_layers()


def test_tensor_parallel_moe_gpt_is_refused_in_one_line() -> None:
    import types
    from shardwise.models.parallelize import parallelize_model
    model = GPT(gpt_config("gpt-moe-tiny", n_layer=2, d_model=32, n_head=4, seq_len=8, moe_d_ff=32))
    with pytest.raises(UserError, match="tensor_parallel.size = 2 with an MoE model .*use tensor_parallel.size = 1"):
        parallelize_model(model, types.SimpleNamespace(size=2))      # type: ignore[arg-type]


def test_context_parallel_moe_gpt_is_refused_in_one_line() -> None:
    from shardwise.config.schema import ContextParallelConfig
    from shardwise.models.context_parallel import check_model_for_context_parallel
    model = GPT(gpt_config("gpt-moe-tiny", n_layer=2, d_model=32, n_head=4, seq_len=8, moe_d_ff=32))
    with pytest.raises(UserError, match="context_parallel.size = 2 with an MoE model .*use context_parallel.size 1"):
        check_model_for_context_parallel(model, ContextParallelConfig(size=2))


def test_expert_layout_is_deepspeeds() -> None:
    ep_groups, expert_dp = expert_layout(range(8), 2)
    assert ep_groups == [(0, 1), (2, 3), (4, 5), (6, 7)] and expert_dp == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert expert_layout(range(4), 4) == ([(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)])
