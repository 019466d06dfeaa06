"""zero_optimization.ignore_unused_parameters = false, in one process (a world of one, CPU): at ZeRO 1 and 2 with
the optimizer offloaded, a global batch in which a trainable parameter got no gradient ends in one line naming
the key (an AssertionError, as DeepSpeed's); with the key true, or without offload (where DeepSpeed does not
check), it trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.comm.collectives import COLLECTIVES_AT_ONE_ENV

# initialize() makes a world of one in this process: torn down after this file (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_world_left_behind")


@pytest.fixture(autouse=True)
def _one_cpu_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_DEVICE", "cpu")
    monkeypatch.setenv(COLLECTIVES_AT_ONE_ENV, "1")


class HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).square().mean()


def _micro_steps(stage: int, offload: bool, ignore: bool) -> int:
    """Micro-batches done before an error (4 when none)."""
    import shardwise
    zero = {"stage": stage, "ignore_unused_parameters": ignore,
            **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    engine, *_ = shardwise.initialize(model=HalfUsed(), config=config)
    done = 0
    try:
        for _ in range(4):
            engine.backward(engine(torch.ones(2, 4)))
            engine.step()
            done += 1
    finally:
        engine.close()
    return done


@pytest.mark.parametrize("stage", [1, 2])
def test_unused_parameters_refused_where_deepspeed_checks(stage: int) -> None:
    from shardwise.errors import UserError
    with pytest.raises(AssertionError, match="ignore_unused_parameters") as info:
        _micro_steps(stage, offload=True, ignore=False)
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)
    assert _micro_steps(stage, offload=True, ignore=True) == 4
    assert _micro_steps(stage, offload=False, ignore=False) == 4
