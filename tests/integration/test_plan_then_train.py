"""What `shardwise plan --write-config` writes trains as written, also when the plan recomputes activations.

On one GPU the search can only trade micro-batch size, recomputation and offload. The memory limit is set
between what the tiny GPT needs at micro-batch 1 with full recomputation and what it needs with selective or
none, so every plan that fits without offload recomputes fully (the search offloads only when nothing fits
without it); the config the planner writes then trains 3 steps under `shardwise train`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PLAN = [sys.executable, "-m", "shardwise.cli.main", "plan", "--model", "tiny", "--gpus", "1", "--global-batch",
        "4", "--seq-len", "128"]


def _total(extra: list[str]) -> float:
    out = subprocess.run(PLAN + extra + ["--json"], capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)["plan"]["memory"]["total"]


def test_a_plan_that_recomputes_trains_as_written(tmp_path: Path) -> None:
    full = _total(["--micro-batch", "1", "--recompute", "full"])
    others = [_total(["--micro-batch", "1", "--recompute", r]) for r in ("none", "selective")]
    assert full < min(others)
    limit_gb = (full + min(others)) / 2 / 1e9
    config = tmp_path / "ds_config.json"
    proc = subprocess.run(PLAN + ["--gpu-memory-gb", f"{limit_gb:.9f}", "--write-config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = json.loads(config.read_text())
    assert written["activation_checkpointing"] == {"policy": "full"}, written
    run = subprocess.run([sys.executable, "-m", "shardwise.cli.main", "train", str(config), "--nproc", "1",
                          "--model", "tiny", "--steps", "3", "--seq-len", "128", "--out", str(tmp_path / "run")],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows)
