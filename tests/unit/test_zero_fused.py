"""`prefer_fused_adam`: the shard masters' Adam/AdamW goes fused only when the user left the choice to torch,
and steps within rounding of torch's default (single-tensor) loop."""

from __future__ import annotations

import pytest
import torch

from shardwise.parallel.zero.fused import prefer_fused_adam


def _masters(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(1000, generator=g)), torch.nn.Parameter(torch.randn(37, generator=g))]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_unspecified_goes_fused_and_matches_the_default_loop(cls: type) -> None:
    params = _masters()
    opt = cls([{"params": params[:1]}, {"params": params[1:], "lr": 1e-3}], lr=1e-2, weight_decay=0.1)
    assert prefer_fused_adam(opt) == 2
    assert all(g["fused"] is True for g in opt.param_groups)
    ref_params2 = _masters()
    ref2 = _train(cls([{"params": ref_params2[:1]}, {"params": ref_params2[1:], "lr": 1e-3}], lr=1e-2,
                      weight_decay=0.1), ref_params2)
    got = _train(opt, params)
    for a, b, start in zip(got, ref2, _masters()):
        assert not torch.equal(a, start)         # it did step
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("choice", [{"foreach": False}, {"foreach": True}, {"fused": False}, {"fused": True}])
def test_an_explicit_choice_is_kept(choice: dict) -> None:
    opt = torch.optim.AdamW(_masters(), **choice)
    before = [(g["foreach"], g["fused"]) for g in opt.param_groups]
    assert prefer_fused_adam(opt) == 0
    assert [(g["foreach"], g["fused"]) for g in opt.param_groups] == before


def test_other_optimizers_unsupported_tensors_and_started_states_are_left_alone() -> None:
    assert prefer_fused_adam(torch.optim.SGD(_masters(), lr=0.1)) == 0
    doubles = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    assert prefer_fused_adam(torch.optim.Adam(doubles)) == 0
    started = torch.optim.Adam(_masters())
    _train(started, started.param_groups[0]["params"], steps=1)
    assert prefer_fused_adam(started) == 0 and started.param_groups[0]["fused"] is None
