"""Runs that go wrong end with one clear line instead of a hang or silent damage (real gloo ranks, bounded):

- a NaN micro-batch in fp32 skips the step on every replica (weights finite, identical, equal to a reference
  that skipped it); steps skipped in a row end the run (fp32 NaN data, bf16 with a huge lr);
- a rank calling backward without step, or running one step fewer, ends in a DesyncError naming the ranks;
- a rank stalling outside collectives ends in a CollectiveTimeout naming it as not arrived.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.errors import CollectiveTimeout, DesyncError, NonFiniteError
from shardwise.testing import run_distributed

WORLD = 2
ROWS = 4          # per rank and micro-batch


class Regression(torch.nn.Module):
    """Float inputs (so data can hold nan): loss = MSE of a two-layer MLP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x), y)


def _data(steps: int, *, nan_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches [WORLD * ROWS, 8] -> [.., 1]; with `nan_at`, one value of rank 1's rows is nan."""
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        x, y = torch.randn(WORLD * ROWS, 8, generator=g), torch.randn(WORLD * ROWS, 1, generator=g)
        if step == nan_at:
            x[ROWS + 1, 3] = float("nan")
        out.append((x, y))
    return out


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, **extra}


def _engine(config: dict, model: torch.nn.Module | None = None):
    model = model or Regression()
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(engine, batches, *, skip_step_at: int | None = None, skip_iteration_at: int | None = None) -> list:
    rank = dist.get_rank()
    applied = []
    for i, (x, y) in enumerate(batches):
        if i == skip_iteration_at and rank == 1:
            continue
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        loss = engine((x[rows].to(engine.compute_dtype), y[rows].to(engine.compute_dtype)))
        engine.backward(loss)
        if i == skip_step_at and rank == 1:
            continue
        engine.step()
        applied.append(engine.was_step_applied())
    return applied


def _error(fn) -> str:
    try:
        fn()
    except (DesyncError, NonFiniteError, CollectiveTimeout) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _skips_and_desync() -> dict:
    out: dict = {}
    # One nan micro-batch (rank 1, step 2) in fp32: skipped everywhere, for the reason the ranks agreed on.
    engine = _engine(_config())
    out["applied"] = _train(engine, _data(5, nan_at=2))
    out["skipped"] = engine.skipped_steps
    out["state"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    # nan data every step on rank 1: the run ends after nonfinite.max_consecutive_skips steps
    engine = _engine(_config(nonfinite={"max_consecutive_skips": 3}))
    out["nan_every_step"] = _error(lambda: [_train(engine, _data(1, nan_at=0)) for _ in range(6)])
    out["nan_steps_taken"] = engine.global_steps
    # bf16 with a huge lr: the first step throws the weights far, every later one overflows and is skipped
    engine = _engine(_config(bf16={"enabled": True}, optimizer={"type": "SGD", "params": {"lr": 1e38}}))
    out["bf16_huge_lr"] = _error(lambda: _train(engine, _data(30)))
    out["bf16_steps_taken"] = engine.global_steps
    # backward without step on rank 1: its next step opens at the same step number as before
    engine = _engine(_config())
    out["backward_without_step"] = _error(lambda: _train(engine, _data(4), skip_step_at=1))
    # rank 1 runs one iteration fewer: the ranks' last checks disagree (rank 1 is at engine.destroy)
    engine = _engine(_config())
    out["one_step_fewer"] = _error(lambda: (_train(engine, _data(4), skip_iteration_at=1), engine.destroy()))
    return out


def _reference(steps_taken: set[int]) -> dict:
    model = Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i, (x, y) in enumerate(_data(5, nan_at=2)):
        if i in steps_taken:
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
    return model.state_dict()


def test_nonfinite_steps_are_skipped_everywhere_and_drift_between_ranks_is_an_error(one_thread) -> None:
    results = run_distributed(_skips_and_desync, world_size=WORLD, timeout=240)
    reference = _reference({0, 1, 3, 4})
    for rank, got in enumerate(results):
        assert got["applied"] == [True, True, False, True, True], (rank, got["applied"])
        assert got["skipped"] == 1
        for k, v in got["state"].items():
            assert torch.isfinite(v).all(), (rank, k)
            assert torch.equal(v, results[0]["state"][k]), f"replicas differ in {k}"
            torch.testing.assert_close(v, reference[k], rtol=1e-5, atol=1e-6)
        assert got["nan_every_step"].startswith("NonFiniteError: step 2 skipped") and "3 in a row" in \
            got["nan_every_step"] and "nonfinite.max_consecutive_skips = 3" in got["nan_every_step"], got
        assert got["nan_steps_taken"] == 3
        assert got["bf16_huge_lr"].startswith("NonFiniteError") and "lr 1e+38" in got["bf16_huge_lr"], got
        assert got["bf16_steps_taken"] == 11      # one applied step, then 10 skipped in a row (the default limit)
        assert got["backward_without_step"].startswith("DesyncError: desync: the ranks are at different steps"), got
        assert "rank(s) 0 start step 2; rank(s) 1 start step 1" in got["backward_without_step"], got
        # The other rank judges its check before its next collective (on the guards' own communicator the check
        # pairs with the ended rank's last one), so both post in time and both name both sides.
        assert got["one_step_fewer"].startswith("DesyncError: desync: the ranks are at different steps"), got
        ended = "rank(s) 1 ended training after step 3 (engine.destroy)"
        assert "rank(s) 0 start step 3; " + ended in got["one_step_fewer"], got


def _stall() -> str:
    engine = _engine(_config(communication={"timeout_minutes": 0.05}))    # 3 s
    batches = _data(3)
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()

    def loop() -> None:
        for i, (x, y) in enumerate(batches):
            if i == 2 and rank == 1:
                # Stalled outside any collective until rank 0 has given up (whatever the machine's load), at
                # most a minute; then its next collective finds rank 0 gone.
                deadline = time.monotonic() + 60
                while not store.check(["test/rank0_gave_up"]) and time.monotonic() < deadline:
                    time.sleep(0.2)
            loss = engine((x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]))
            engine.backward(loss)
            engine.step()
    message = _error(loop)
    if rank == 0:
        store.set("test/rank0_gave_up", "1")
    return message


def test_a_stalled_rank_is_named_by_every_rank(one_thread, capfd: pytest.CaptureFixture) -> None:
    results = run_distributed(_stall, world_size=WORLD, timeout=240)
    for message in results:
        assert message.startswith('CollectiveTimeout: rank(s) 1 stalled: rank(s) 0 waited '), message
        assert "(collective timeout at steps [1, 2] after 3 s" in message, message
        assert "rank(s) 1 did not arrive (rank 1: step 1, outside any collective, last completed" in message, message
        assert 's for them in all_reduce on "world:check"' in message, message
    assert results[0] == results[1]
