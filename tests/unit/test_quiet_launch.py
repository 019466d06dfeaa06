"""Nothing printed at install or launch that carries no information for the user."""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_metadata_applies_without_setuptools_warnings(monkeypatch) -> None:
    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration

    monkeypatch.chdir(ROOT)                     # the readme path in pyproject.toml is relative
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(setuptools.Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in caught] == []
    assert dist.get_name() == "shardwise"


def test_benchmark_launcher_sets_the_thread_count_torchrun_would_announce(monkeypatch) -> None:
    from benchmarks import common

    seen: list[dict[str, str]] = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, check, env: seen.append(env) or
                        subprocess.CompletedProcess(cmd, 0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    common.run_under_launcher("benchmarks.allreduce", 2, [])
    common.run_under_launcher("benchmarks.allreduce", 1, [])
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    common.run_under_launcher("benchmarks.allreduce", 2, [])
    assert [env.get("OMP_NUM_THREADS") for env in seen] == ["1", None, "3"]
