"""`shardwise train --model hf:DIR` trains in train mode: transformers' `from_pretrained` hands back an eval-mode
model, which would train with dropout off (and without the engine's activation and communication records)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardwise.cli.train_model import build_run_model

transformers = pytest.importorskip("transformers")


def _gpt2(path: Path) -> Path:
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def _llama(path: Path) -> Path:
    cfg = transformers.LlamaConfig(vocab_size=64, max_position_embeddings=16, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                   attention_dropout=0.5)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("save", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_saved_weights_build_in_train_mode_with_dropout_on(tmp_path: Path, save) -> None:
    directory = save(tmp_path / "hf")
    args = SimpleNamespace(out=str(tmp_path / "run"), model=f"hf:{directory}", seq_len=8, vocab_size=None)
    choice, model = build_run_model(args)
    assert choice.hf_weights                      # the from_pretrained path, which returns eval mode
    assert [name for name, m in model.named_modules() if not m.training] == []
    ids = torch.arange(16).reshape(2, 8)
    torch.manual_seed(0)
    first = model(input_ids=ids).logits
    second = model(input_ids=ids).logits
    assert not torch.equal(first, second)         # dropout draws new masks in train mode
