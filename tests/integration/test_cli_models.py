"""The whole workflow through the command line: `shardwise train` a Llama-style preset at TP 2 with a held-out
evaluation -> `shardwise eval` (on one process: the loss the run's last evaluation logged) -> `generate` ->
`export --to hf` -> transformers loads it and gives the same loss and the same greedy continuation; then
`train --model hf:EXPORT` continues from those weights under ZeRO-3 (learning rate 0: the weights must come back
unchanged through a ZeRO-3 checkpoint), and `export --to safetensors` writes our names. Two launches of 2 ranks,
the rest in this process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.cli.main import main
from shardwise.telemetry import read_metrics

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TRAIN = [sys.executable, "-m", "shardwise.cli.main", "train"]
SEQ = 32


def _train(*args: str) -> None:
    proc = subprocess.run(TRAIN + ["--nproc", "2", "--seq-len", str(SEQ), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _config(path: Path, **extra) -> str:
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
                                "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, **extra}))
    return str(path)


def _out(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_train_eval_generate_export_and_load_in_transformers(tmp_path: Path, capsys, one_thread) -> None:
    from transformers import AutoModelForCausalLM

    from shardwise.data import ByteTokenizer
    corpus = tmp_path / "corpus.txt"                   # not UTF-8 on purpose: every byte is a token
    corpus.write_bytes(b"".join(f"line {i}: caf\xe9 {i * i % 97}\n".encode("latin-1") for i in range(3000)))
    run = tmp_path / "run"
    _train(_config(tmp_path / "tp2.json", tensor_parallel={"size": 2}), "--model", "llama-tiny", "--data",
           str(corpus), "--steps", "4", "--eval-every", "2", "--eval-batches", "2", "--save-every", "4",
           "--out", str(run))
    rows = read_metrics(run / "metrics.jsonl")
    assert [("eval_loss" in r) for r in rows] == [False, True, False, True]
    assert all(r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"])) for r in rows if "eval_loss" in r)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_eval_loss"] == rows[-1]["eval_loss"]

    # eval: the held-out split by default (the corpus's last 5%), or any corpus
    held = json.loads(_out(capsys, "eval", str(run), "--json", "--max-windows", "8"))
    assert held["data"].endswith("(held-out split)") and held["windows"] == 8 and held["tokens"] == 8 * SEQ
    # the 8 windows the run's last evaluation read (2 batches of 4, dp 1), now on one process from TP slices
    assert held["loss"] == pytest.approx(rows[-1]["eval_loss"], rel=1e-5)
    # by default: the windows the run's evaluation read at this checkpoint, so the figure it logged, said so
    default = json.loads(_out(capsys, "eval", str(run), "--json"))
    assert default["windows"] == 8 and default["averaged_over"] == "the windows of the run's held-out evaluation " \
                                                                  "at step 4"
    assert default["loss"] == pytest.approx(rows[-1]["eval_loss"], rel=1e-5) and default["run_eval_loss"] == \
        rows[-1]["eval_loss"]
    said = _out(capsys, "eval", str(run / "checkpoints" / "global_step4"))
    assert "8 windows of 32 tokens, 256 predictions" in said and "the run logged eval loss" in said
    mine = json.loads(_out(capsys, "eval", str(run / "checkpoints"), "--data", str(corpus), "--max-windows", "3",
                           "--json"))
    greedy = _out(capsys, "generate", str(run), "--prompt", "line 7", "--max-new-tokens", "12", "--temperature", "0")
    _out(capsys, "export", str(run), "--to", "hf", "--out", str(tmp_path / "hf"))

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = np.fromfile(corpus, dtype=np.uint8)[: 3 * SEQ + 1].astype(np.int64)
    rows3 = torch.from_numpy(ids[np.arange(3)[:, None] * SEQ + np.arange(SEQ + 1)])     # the 3 windows eval read
    with torch.no_grad():
        logits = hf(input_ids=rows3[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), rows3[:, 1:].reshape(-1))
        assert float(loss) == pytest.approx(mine["loss"], rel=1e-5)
        prompt = torch.tensor([ByteTokenizer().encode("line 7")])
        theirs = hf.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=0)[0]
    assert greedy.rstrip("\n").encode("utf-8", "surrogateescape") == bytes(theirs.tolist()).decode(
        "utf-8", errors="replace").encode("utf-8", "surrogateescape")

    # hf:PATH with save_pretrained weights, ZeRO-3 over 2 ranks, lr 0: the checkpoint gives the weights back
    run2 = tmp_path / "run2"
    zero3 = _config(tmp_path / "z3.json", zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0},
                    optimizer={"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0}})
    _train(zero3, "--model", f"hf:{tmp_path / 'hf'}", "--data", str(corpus), "--steps", "1", "--save-every", "1",
           "--out", str(run2))
    # from_pretrained returns an eval-mode model: the run trains it in train mode, so the summary measures the
    # step's collectives (ZeRO-3 over 2 ranks gathers and reduce-scatters) and the saved activations
    trained = json.loads((run2 / "summary.json").read_text())
    assert trained["comm_bytes_per_step"] > 0
    assert all(rank["activations"] > 0 for rank in trained["memory_per_rank"])
    _out(capsys, "export", str(run2), "--to", "safetensors", "--out", str(tmp_path / "st"))
    from safetensors.torch import load_file
    again = load_file(str(tmp_path / "st" / "model.safetensors"))
    for name, value in hf.state_dict().items():
        assert torch.equal(again[name], value), name
