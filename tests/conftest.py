"""Fixtures shared by the test files.

The pieces that spawned ranks import as well (the tiny GPT, token batches, the reference trainer) are in
`shardwise.testing`: a rank unpickles its target by module path, and a conftest is not importable there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
import torch

FAULT_INJECTION = Path(__file__).parent / "fault_injection"


@pytest.fixture
def one_thread():
    """One intra-op thread while a test computes its single-process reference: the references are tiny,
    the ranks it compares with run one thread each, and the machine's cores are shared. The previous
    setting is restored, so the next test in this process is unaffected."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def private_peak_cache(tmp_path_factory):
    """Runs started by the tests (and their spawned ranks, which inherit the environment) keep their
    measured peak FLOP/s in a temporary cache, never in the user's."""
    from shardwise.telemetry.peak_cache import CACHE_ENV

    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("peak_cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before


@pytest.fixture
def kill_rank_after_step() -> Callable[..., dict[str, str]]:
    """`kill_rank_after_step(rank=R, step=S)`: the environment for a launched `shardwise train` in which global
    rank R kills itself with SIGKILL once step S is done, on the first attempt only. Its ranks load
    tests/fault_injection/sitecustomize.py at start-up (put first on PYTHONPATH), which does it."""
    from fault_injection.sitecustomize import KILL_ENV

    def env(*, rank: int, step: int) -> dict[str, str]:
        path = [str(FAULT_INJECTION)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return {"PYTHONPATH": os.pathsep.join(path), KILL_ENV: f"{rank}:{step}"}

    return env


@pytest.fixture(scope="module")
def no_world_left_behind():
    """A test file that calls initialize() in-process makes a world of one: tear it down after that file, so that
    later tests in the same process (which check they start and end without one) do not depend on the order."""
    import torch.distributed as dist
    before = dist.is_initialized()
    yield
    if dist.is_initialized() and not before:
        dist.destroy_process_group()



@pytest.fixture(autouse=True, scope="session")
def warm_ranks():
    """The suite's distributed tests reuse their ranks within a test module (shardwise.testing.ranks: about 2 s of
    CPU saved per spawned rank); they end with the session. SHARDWISE_TEST_RANK_POOL=0 spawns every launch afresh."""
    from shardwise.testing.ranks import POOL_ENV, close_warm_ranks

    before = os.environ.get(POOL_ENV)
    os.environ.setdefault(POOL_ENV, "1")
    yield
    close_warm_ranks()
    if before is None:
        os.environ.pop(POOL_ENV, None)
    else:
        os.environ[POOL_ENV] = before
