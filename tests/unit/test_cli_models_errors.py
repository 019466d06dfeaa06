"""Mistakes with the model, evaluation and checkpoint flags: one line naming the flag, exit code 2, before any
rank starts (train) or any weight is read (eval, generate, export)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardwise.cli.main import main


def _error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("shardwise: error: "), err
    return err


def test_train_model_and_eval_flags(capsys, tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "run")]
    assert "did you mean 'llama-7b'" in _error(capsys, "train", "--model", "llama-7", *out).lower()
    assert "no config.json" in _error(capsys, "train", "--model", f"hf:{tmp_path}", *out)
    assert "--vocab-size 0: must be at least 1" in _error(capsys, "train", "--vocab-size", "0", *out)
    assert "--eval-every -1" in _error(capsys, "train", "--eval-every", "-1", *out)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(600, dtype=np.int32))
    assert "--vocab-size 600 or more" in _error(capsys, "train", "--data", str(ids), *out)
    assert "byte-level text" in _error(capsys, "train", "--vocab-size", "100", *out)


def test_pipeline_of_an_hf_model_is_refused(capsys, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "max_position_embeddings": 32}))
    config = tmp_path / "pp.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                                  "pipeline": {"stages": 2}}))
    err = _error(capsys, "train", str(config), "--nproc", "2", "--model", f"hf:{tmp_path / 'config.json'}",
                 "--out", str(tmp_path / "run"))
    assert "pipeline.stages = 2" in err and "preset such as llama-tiny" in err
    assert "longer than the model's context 32" in _error(capsys, "train", "--model", f"hf:{tmp_path}", "--seq-len",
                                                         "64", "--out", str(tmp_path / "run"))


def test_checkpoint_commands(capsys, tmp_path: Path) -> None:
    assert "no such run directory" in _error(capsys, "eval", str(tmp_path / "nothing"))
    (tmp_path / "run").mkdir()
    assert "no model.json" in _error(capsys, "generate", str(tmp_path / "run"), "--prompt", "x")
    assert "holds no checkpoint" in _error(capsys, "eval", str(tmp_path / "run"), "--model", "tiny")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert "not an empty directory" in _error(capsys, "export", str(tmp_path / "run"), "--to", "hf", "--out",
                                              str(tmp_path / "full"))
    assert "--max-new-tokens -1" in _error(capsys, "generate", str(tmp_path / "run"), "--max-new-tokens", "-1")
