"""The suite's warm ranks (`shardwise.testing.ranks`): a launch reuses the ranks of the previous launch of its test
module, and nothing of one call reaches the next: the process state a call changes is put back, and a rank whose
call failed or left a thread running is replaced."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import DistributedTestError, run_distributed
from shardwise.testing.ranks import POOL_ENV


def _identity_and_state() -> dict:
    return {"pid": os.getpid(), "rank": dist.get_rank(), "env": os.environ.get("WARM_RANKS_MARK"),
            "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
            "threads": torch.get_num_threads(), "cwd": os.getcwd()}


def _change_process_state() -> int:
    os.environ["WARM_RANKS_MARK"] = "left by a call"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(3)
    os.chdir("/")
    return os.getpid()


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank one fails")
    return os.getpid()


def _leave_a_thread() -> int:
    threading.Thread(target=time.sleep, args=(30,), name="left-behind", daemon=True).start()
    return os.getpid()


@pytest.fixture(autouse=True)
def warm(monkeypatch):
    monkeypatch.setenv(POOL_ENV, "1")


def test_ranks_are_reused_and_each_call_starts_clean(tmp_path, monkeypatch) -> None:
    first = run_distributed(_identity_and_state, 2)
    assert [r["rank"] for r in first] == [0, 1]
    pids = [r["pid"] for r in first]

    assert run_distributed(_change_process_state, 2) == pids            # the same processes
    # The parent's environment and directory at this launch are what a fresh spawn would inherit.
    monkeypatch.setenv("WARM_RANKS_MARK", "the parent's")
    monkeypatch.chdir(tmp_path)
    after = run_distributed(_identity_and_state, 2)
    assert [r["pid"] for r in after] == pids
    for r in after:
        assert r["env"] == "the parent's" and r["cwd"] == str(tmp_path)
        assert (r["dtype"], r["grad"], r["threads"]) == (torch.float32, True, 1)

    # A fresh launch is asked for: other processes, the warm ones kept.
    fresh = run_distributed(_identity_and_state, 2, fresh=True)
    assert not set(r["pid"] for r in fresh) & set(pids)
    assert [r["pid"] for r in run_distributed(_identity_and_state, 2)] == pids


def test_a_failed_call_or_a_thread_left_running_retires_the_ranks() -> None:
    pids = [r["pid"] for r in run_distributed(_identity_and_state, 2)]
    with pytest.raises(DistributedTestError, match="rank one fails"):
        run_distributed(_fail_on_rank_one, 2)
    replaced = [r["pid"] for r in run_distributed(_identity_and_state, 2)]
    assert not set(replaced) & set(pids)

    assert run_distributed(_leave_a_thread, 2) == replaced
    again = [r["pid"] for r in run_distributed(_identity_and_state, 2)]
    assert not set(again) & set(replaced)
