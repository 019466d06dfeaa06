"""The routing rule against DeepSpeed 0.19's own gate, on one process: the same logits (or gate weights and
input) and the same seed give the same per-token expert weights, l_aux and exp_counts, for top-1 (random token
selection, RSample and Jitter noise, dropping on and off), top-2 (second-expert sampling, dropping by position)
and top-3 (dropping by score). Their random draws come from the default generator in the same order, so the
noise and the random selection are bitwise the same draws."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from shardwise.moe.layer import MoE


def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    from deepspeed.moe.sharded_moe import TopKGate
    return TopKGate


CASES = {
    "top1_rts_drop": dict(k=1, capacity_factor=1.0, drop_tokens=True, use_rts=True),
    "top1_in_order_no_drop": dict(k=1, drop_tokens=False, use_rts=False),
    "top1_rsample_drop": dict(k=1, capacity_factor=0.5, noisy_gate_policy="RSample"),
    "top1_jitter_drop": dict(k=1, capacity_factor=0.75, noisy_gate_policy="Jitter"),
    "top2_sampled_drop": dict(k=2, capacity_factor=0.5),
    "top2_no_drop": dict(k=2, drop_tokens=False, top2_2nd_expert_sampling=False),
    "top3_drop_by_score": dict(k=3, capacity_factor=0.5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_routing_equals_deepspeeds_gate(name: str) -> None:
    TopKGate = _deepspeed()
    args = dict(CASES[name])
    hidden, experts, tokens = 8, 4, 24
    ours = MoE(hidden, torch.nn.Linear(hidden, hidden), num_experts=experts, min_capacity=0, **args)
    ours.train()
    router = ours.deepspeed_moe.gate
    theirs = TopKGate(hidden, experts, args["k"], args.get("capacity_factor", 1.0), 1.0, 0,
                      args.get("noisy_gate_policy"), args.get("drop_tokens", True), args.get("use_rts", True),
                      None, args.get("top2_2nd_expert_sampling", True))
    theirs.train()
    with torch.no_grad():
        theirs.wg.weight.copy_(router.wg.weight)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))

    torch.manual_seed(7)
    l_aux, combine, _, counts = theirs(x)                      # combine [S, E, C]
    torch.manual_seed(7)
    routing = router(x)
    weights = torch.zeros(tokens, experts).scatter_add_(1, routing.expert, routing.weight)
    torch.testing.assert_close(weights, combine.sum(-1), rtol=1.3e-6, atol=1e-7)
    torch.testing.assert_close(routing.aux_loss, l_aux)
    assert routing.counts.tolist() == counts.tolist()
    if args.get("drop_tokens", True):
        assert not bool(routing.kept.all()), "the case should drop tokens"


def test_param_groups_split_as_deepspeeds() -> None:
    _deepspeed()
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as theirs_split
    from shardwise.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer as ours_split

    def groups_of(split, limit):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), MoE(8, torch.nn.Linear(8, 8), num_experts=2))
        dense = [p for p in model.parameters() if not is_moe_param(p)]
        expert = [p for p in model.parameters() if is_moe_param(p)]
        names = {id(p): n for n, p in model.named_parameters()}
        given = [{"params": dense[:1] + expert[:2], "name": "a", "weight_decay": 0.1},
                 {"params": dense[1:] + expert[2:], "name": "b", "lr": 0.5}]
        out = split(given, max_group_size=limit)
        return [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]]) for g in out]

    for limit in (None, 80, 178956971):
        assert groups_of(ours_split, limit) == groups_of(theirs_split, limit)


@pytest.mark.parametrize("args", [dict(k=1, use_residual=True), dict(k=2, capacity_factor=0.5),
                                  dict(k=2, drop_tokens=False, noisy_gate_policy="Jitter")])
def test_whole_layer_equals_deepspeeds_at_ep_1(args: dict) -> None:
    """DeepSpeed's MoE state dict loads into ours by its own names (strict), and output, l_aux and exp_counts
    agree, gradients too."""
    _deepspeed()
    from deepspeed.moe.layer import MoE as TheirMoE

    def expert() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))

    torch.manual_seed(0)
    theirs = TheirMoE(8, expert(), num_experts=4, min_capacity=0, **args)
    ours = MoE(8, expert(), num_experts=4, min_capacity=0, **args)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(1))
    xs, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(5)
    out_t, aux_t, counts_t = theirs(xs)
    torch.manual_seed(5)
    out_o, aux_o, counts_o = ours(xo)
    torch.testing.assert_close(out_o, out_t, rtol=1.3e-6, atol=1e-6)
    torch.testing.assert_close(aux_o, aux_t)
    assert counts_o.tolist() == counts_t.tolist()
    (out_t.square().sum() + aux_t).backward()
    (out_o.square().sum() + aux_o).backward()
    assert xo.grad is not None and xs.grad is not None
    torch.testing.assert_close(xo.grad, xs.grad, rtol=1e-5, atol=1e-6)
    grads_t = {n: p.grad for n, p in theirs.named_parameters()}
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads_t[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
