"""Fixtures shared by the test files.

The pieces that spawned ranks import as well (the tiny GPT, token batches, the reference trainer) are in
`shardwise.testing`: a rank unpickles its target by module path, and a conftest is not importable there.
"""

from __future__ import annotations

import pytest
import torch


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
    import os

    from shardwise.telemetry.peak_cache import CACHE_ENV

    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("peak_cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before
