"""`scripts/gpu_check.sh --device cpu`: every phase of the GPU check runs green on the CPU, so the script itself is
known to work before a GPU machine is lent; a phase past its timeout is killed and reported as one FAIL row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_phase_runs_green_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    rows = summary["rows"]
    assert summary["failed"] == [] and {r["status"] for r in rows} <= {"PASS", "INFO", "SKIP"}
    assert {r["check"].split(".")[0] for r in rows} == {"A", "B", "C", "D"}
    checks = {r["check"]: r for r in rows}
    for name in ("A.all_reduce_fp32", "A.reduce_scatter", "A.ring_all_reduce", "B.fp32_stage3_params_vs_stage0",
                 "B.fp16_forced_overflow", "B.host_reads_stage0_bf16", "D.zero2_loss_vs_reference",
                 "D.tp2_loss_vs_reference"):
        assert checks[name]["status"] == "PASS", checks[name]
    assert "C.mfu_stage0" in checks and "C.zero_offload_h2d_gbps" in checks
    assert proc.stdout.splitlines()[0].split()[:4] == ["CHECK", "STATUS", "VALUE", "LIMIT"]


def test_a_phase_past_its_timeout_is_one_fail_row(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.gpu_check import run_phase
    finally:
        sys.path.remove(str(ROOT))
    rows, seconds = run_phase("A", "cpu", 0.2, tmp_path)
    assert [(r["check"], r["status"], r["detail"]) for r in rows] == [("A.phase", "FAIL", "timed out")]
    assert seconds < 30
