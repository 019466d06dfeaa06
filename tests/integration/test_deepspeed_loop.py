"""A DeepSpeed-style training loop (examples/deepspeed_loop.py) runs with `import shardwise` in place of
`deepspeed`, as one process and under torchrun."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nproc", [1, 2])
def test_deepspeed_style_loop(tmp_path, nproc):
    summary = tmp_path / "summary.json"
    script = [str(ROOT / "examples" / "deepspeed_loop.py"), "--config", str(ROOT / "examples" / "ds_config.json"),
              "--samples", "64", "--summary", str(summary)]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(summary.read_text())
    # 64 samples, global batch 16 -> 4 optimizer steps of 2 accumulated micro-batches
    assert out["global_steps"] == 4 and out["dp_size"] == nproc
    assert len(out["losses"]) == 64 // nproc // (16 // 2 // nproc)   # micro-batches seen by rank 0
    assert out["losses"][-1] < out["losses"][0]
