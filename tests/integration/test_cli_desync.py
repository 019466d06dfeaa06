"""`shardwise train` with a rank that makes one extra collective (with torch.distributed itself, inside a step):
the run ends in one line naming the desync, exit 2, instead of gloo's abort text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TRAIN = [sys.executable, "-m", "shardwise.cli.main", "train"]
FAULT_INJECTION = Path(__file__).resolve().parents[1] / "fault_injection"


def test_an_extra_collective_on_one_rank_ends_in_one_desync_line_and_exit_2(tmp_path: Path) -> None:
    from fault_injection.sitecustomize import EXTRA_COLLECTIVE_ENV

    corpus = tmp_path / "corpus.txt"
    corpus.write_text((Path(json.__file__).read_text() * 40)[:100_000])
    path = [str(FAULT_INJECTION)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path), EXTRA_COLLECTIVE_ENV: "1:2"}
    proc = subprocess.run(TRAIN + ["--nproc", "2", "--data", str(corpus), "--seq-len", "32", "--steps", "3",
                                   "--peak-tflops", "0.1", "--out", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("shardwise: error: desync at step 1: rank(s) 1 failed gloo's message-size check in "
                                  "a collective shardwise did not launch (torch.distributed called directly?); rank 0 "
                                  'waits in all_reduce float32['), proc.stderr
