"""The plain-loop example (examples/fsdp_loop.py) runs under torchrun with fully_shard per block and root, bf16
compute and gradient accumulation, and saves the whole model."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fsdp_loop_example_under_torchrun(tmp_path):
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "examples" / "fsdp_loop.py"), "--bf16", "--samples", "48", "--summary", str(summary)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(summary.read_text())
    assert out["world"] == 2 and len(out["losses"]) == 48 // 2 // 4       # micro-batches of 4 seen by rank 0
    assert out["losses"][-1] < out["losses"][0]
    from shardwise.models import GPT, gpt_config
    assert out["state_numel"] == GPT(gpt_config("tiny", n_layer=2, d_model=64, n_head=4, seq_len=32)).num_params()
