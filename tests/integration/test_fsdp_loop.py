"""The plain-loop example (examples/fsdp_loop.py) runs under torchrun with fully_shard per block and root, bf16
compute and gradient accumulation, and saves the whole model and optimizer state, keyed by name."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fsdp_loop_example_under_torchrun(tmp_path):
    summary, ckpt = tmp_path / "summary.json", tmp_path / "ckpt.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "examples" / "fsdp_loop.py"), "--bf16", "--samples", "48", "--summary", str(summary),
           "--save", str(ckpt)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(summary.read_text())
    assert out["world"] == 2 and len(out["losses"]) == 48 // 2 // 4       # micro-batches of 4 seen by rank 0
    assert out["losses"][-1] < out["losses"][0]
    import torch
    from shardwise.models import GPT, gpt_config
    model = GPT(gpt_config("tiny", n_layer=2, d_model=64, n_head=4, seq_len=32))
    assert out["state_numel"] == model.num_params()
    saved = torch.load(ckpt)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    assert {k: v.shape for k, v in saved["model"].items() if k in shapes} == shapes
    # AdamW's moments whole; 3 optimizer steps: 48 samples over 2 ranks, 4 per micro-batch, 2 micro-batches a step
    state = saved["optim"]["state"]
    assert state.keys() == shapes.keys() and saved["optim"]["param_groups"][0]["params"] == list(shapes)
    assert all(s["exp_avg"].shape == shapes[n] and float(s["step"]) == 3 for n, s in state.items())
