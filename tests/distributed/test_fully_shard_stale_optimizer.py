"""An optimizer built before `fully_shard` holds the parameter objects the wrapping replaced (the model now holds
DTensor parameters): its first step is refused in one line naming the fix, instead of silently stepping nothing.
An optimizer built after wrapping, the normal path, steps as before. One rank shows it (the replacement happens at
every dp size)."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _rank() -> dict:
    import shardwise
    model = _model()
    early = torch.optim.AdamW(model.parameters(), lr=0.1)
    early_inner = torch.optim.SGD(model[2].parameters(), lr=0.1)       # built on a block wrapped on its own
    shardwise.fully_shard(model[2])
    shardwise.fully_shard(model)
    refused = []
    for optimizer in (early, early_inner):
        try:
            _step(model, optimizer)
        except shardwise.UserError as e:
            refused.append(str(e))
    late = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    for _ in range(2):             # the second step is the checked optimizer's fast path
        _step(model, late)
    moved = [not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters())]
    return {"refused": refused, "moved": moved}


def test_an_optimizer_built_before_fully_shard_is_refused_at_its_step() -> None:
    out = run_distributed(_rank, 1, timeout=120)[0]
    assert len(out["refused"]) == 2, out["refused"]
    for line, name, count in zip(out["refused"], ("AdamW", "SGD"), (6, 2)):
        assert line.startswith(f"{name}.step(): {count} of its parameters were replaced by fully_shard")
        assert "build the optimizer after fully_shard(model)" in line and "\n" not in line
    assert out["moved"] == [True] * 6
