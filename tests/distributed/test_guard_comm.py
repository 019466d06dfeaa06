"""The guards' own communicator (real gloo ranks): the desync check and the stop vote run on a process group of
their own, so they never pair with a training collective; a rank that makes an extra collective ends the run in
one DesyncError line naming the ranks and the operations, not in the backend's abort.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.comm.collectives import Comm
from shardwise.errors import CollectiveTimeout, DesyncError
from shardwise.testing import DistributedTestError, run_distributed

ROWS = 4


def _engine(**extra):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, **extra}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    x, y = torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 1, generator=g)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()


def _stop_vote_and_groups() -> dict:
    rank = dist.get_rank()
    out: dict = {}
    engine = _engine()
    check = engine.sequence_check
    training = {id(g) for g in (None, dist.group.WORLD)}
    out["own_group"] = check.comm.group is not None and id(check.comm.group) not in training \
        and str(dist.get_backend(check.comm.group)) == "gloo"
    votes = []
    for i in range(4):
        _step(engine, i)
        votes.append(check.agree_stop(15 if (rank == 1 and i >= 1) else 0))
    out["votes"] = votes
    # one guard collective per step: the check, which carries the vote (no all-reduce of the vote's own); the
    # ledger keeps the last two steps
    out["guard_ops"] = [sum(r["count"] for r in engine.comm_report(s) if r["group"] == "world:check")
                        for s in (2, 3)]
    engine.destroy()
    # With the check off the vote is one all-reduce of its own, answered at once.
    engine = _engine(communication={"desync_check": False})
    _step(engine, 0)
    out["vote_without_check"] = engine.sequence_check.agree_stop(2 if rank == 0 else 0)
    out["check_off_guard_ops"] = sum(r["count"] for r in engine.comm_report(0) if r["group"] == "world:check")
    engine.destroy()
    return out


def test_the_check_and_the_stop_vote_run_on_their_own_gloo_group(one_thread) -> None:
    results = run_distributed(_stop_vote_and_groups, world_size=2, timeout=180)
    for got in results:
        assert got["own_group"]
        # rank 1 asks after step 1: its vote rides in step 2's check, read by every rank after step 2
        assert got["votes"] == [0, 0, 15, 15], got
        assert got["guard_ops"] == [1, 1], got
        assert got["vote_without_check"] == 2, got
        assert got["check_off_guard_ops"] == 1, got     # the vote's own all-reduce


def _extra_collective(where: str) -> str:
    engine = _engine(communication={"timeout_minutes": 0.05})      # 3 s
    rank = dist.get_rank()
    extra = Comm(None, engine.ledger, name="dp")    # the data-parallel group, as the engine's buckets use it
    try:
        for i in range(4):
            if i == 2 and rank == 1 and where == "between steps":
                extra.all_reduce(torch.ones(3))
            g = torch.Generator().manual_seed(i * 10 + rank)
            x, y = torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 1, generator=g)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            if i == 2 and rank == 1 and where == "inside a step":
                extra.all_reduce(torch.ones(3))
            if i == 2 and rank == 1 and where == "inside a step, outside shardwise":
                dist.all_reduce(torch.ones(3))      # a collective no ledger sees
            engine.backward(loss)
            engine.step()
        engine.destroy()
    except (DesyncError, CollectiveTimeout) as e:
        if where != "between steps":      # one rank aborts: the harness shows the others' errors as failures
            raise
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_an_extra_collective_on_one_rank_is_one_desync_line_naming_ranks_and_ops(one_thread) -> None:
    results = run_distributed(_extra_collective, world_size=2, args=("between steps",), timeout=180)
    for message in results:
        assert message.startswith("DesyncError: desync at step"), results
        assert "the ranks wait in collectives that cannot pair" in message, message
        assert 'rank(s) 1 wait in all_reduce float32[3] on "dp"' in message and "which rank(s) 0 did not launch" \
            in message, message
        assert 'rank(s) 0 wait in all_reduce int64[' in message and 'on "world:check"' in message, message
    assert results[0] == results[1]


class _ReturnsBeforeCompleting:
    """A collective's work as NCCL gives it: `wait()` returns at once (it only orders the current stream), while the
    collective itself has not completed (here: until `done` is set)."""

    def __init__(self) -> None:
        self.done = False

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.done


def _stalled_after_wait() -> dict:
    import time

    from shardwise.comm.ledger import CommLedger
    from shardwise.comm.watchdog import HangWatchdog

    ledger = CommLedger()
    store = dist.distributed_c10d._get_default_store()
    dog = HangWatchdog.attach(ledger, rank=0, world=1, timeout_s=0.5, store=store)
    assert dog is not None
    work = _ReturnsBeforeCompleting()
    real = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: work
    try:
        Comm(None, ledger, name="dp", force_collectives=True).all_reduce(torch.ones(4))     # returns at once
    finally:
        dist.all_reduce = real
    out = {"waiting_after_wait": [(w.op, w.group, w.seq) for w in ledger.waiting()]}
    deadline = time.monotonic() + 30
    key = f"{dog.prefix}/verdict"
    while not store.check([key]) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["verdict"] = store.get(key).decode() if store.check([key]) else None
    work.done = True
    out["waiting_once_completed"] = ledger.waiting()
    out["last_done"] = ledger.last_done.op if ledger.last_done is not None else None
    dog.stop()
    dog.join(5)
    return out


def test_the_watchdog_counts_a_collective_as_waiting_until_it_completes_not_until_wait_returns() -> None:
    (got,) = run_distributed(_stalled_after_wait, world_size=1, timeout=120)
    assert got["waiting_after_wait"] == [("all_reduce", "dp", 1)], got
    assert got["verdict"] is not None and 'rank(s) 0 wait in all_reduce on "dp" #1' in got["verdict"], got
    assert got["waiting_once_completed"] == [] and got["last_done"] == "all_reduce", got


def _desync_line_after_abort(where: str, capfd) -> str:
    """rank 1's extra all-reduce meets rank 0's first gradient bucket: gloo's size check fails on rank 1's I/O thread
    and aborts it; rank 1 reports before it goes (exit 1), and rank 0 raises the line when its collective fails."""
    with pytest.raises(DistributedTestError) as failed:
        run_distributed(_extra_collective, world_size=2, args=(where,), timeout=180)
    text = str(failed.value)
    lines = [line for line in text.splitlines() if line.startswith("shardwise.errors.DesyncError")]
    assert len(lines) == 1, text
    assert "ranks [1] did not finish" in text and "exit codes [1]" in text, text
    stderr = capfd.readouterr().err
    assert "terminate called" not in stderr and "EnforceNotMet" not in stderr, stderr
    return lines[0]


def test_an_extra_collective_inside_a_step_is_the_desync_line_not_gloos_abort(one_thread, capfd) -> None:
    line = _desync_line_after_abort("inside a step", capfd)
    assert line.startswith("shardwise.errors.DesyncError: desync at step 2: operation "), line
    assert 'on "dp" since the last check differs: rank(s) 0 ran all_reduce float32[' in line, line
    assert "rank(s) 1 ran all_reduce float32[3]" in line, line
    # the same for a collective made with torch.distributed itself, which no ledger records
    line = _desync_line_after_abort("inside a step, outside shardwise", capfd)
    assert line.startswith("shardwise.errors.DesyncError: desync at step 2: rank(s) 1 failed gloo's message-size "
                           "check in a collective shardwise did not launch (torch.distributed called directly?); "
                           "rank 0 waits in all_reduce float32["), line
