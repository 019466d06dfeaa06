"""What `shardwise.initialize` fills "auto" values from, as Hugging Face's integration does: the model's hidden
size (`config.hidden_size`, else the largest of `config.hidden_sizes`, else the same under `config.text_config`),
and what it refuses: an "auto" it cannot fill (a learning rate: Hugging Face's Trainer fills it from its
arguments), one line per key naming the key and the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardwise.engine.initialize import hidden_size_of
from shardwise.testing import tiny_gpt


# initialize() here makes a world of one in this process: torn down after this file (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_world_left_behind")


def _with_config(**config) -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(**config)
    return model


@pytest.mark.parametrize("config, size", [
    ({"hidden_size": 48, "hidden_sizes": [96, 768]}, 48),            # hidden_size first
    ({"hidden_sizes": [96, 768, 384]}, 768),                         # the largest stage (ConvNeXt, ResNet, ...)
    ({"text_config": SimpleNamespace(hidden_size=4096), "vision_config": SimpleNamespace(hidden_size=1024)}, 4096),
    ({"text_config": SimpleNamespace(hidden_sizes=[64, 128])}, 128),
    ({"hidden_sizes": [32], "text_config": SimpleNamespace(hidden_size=64)}, 32),
    ({"vocab_size": 10}, None),
])
def test_hidden_size_where_hugging_face_looks(config: dict, size: int | None) -> None:
    assert hidden_size_of(_with_config(**config)) == size


def test_our_gpt_gives_its_width() -> None:
    assert hidden_size_of(tiny_gpt(n_layer=1, d_model=32)) == 32


def test_an_auto_learning_rate_without_a_trainer_is_one_line_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardwise
    monkeypatch.setenv("SHARDWISE_DEVICE", "cpu")
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}}}
    with pytest.raises(shardwise.UserError) as info:
        shardwise.initialize(model=tiny_gpt(n_layer=1), config=config)
    message = str(info.value)
    assert "\n" not in message and message.startswith('"optimizer.params.lr": "auto" needs the learning rate')
    assert "AutoValues(lr=...)" in message and "write the value" in message
    # the same config with the value given trains (the hidden size filled reduce_bucket_size from the model)
    engine, *_ = shardwise.initialize(model=tiny_gpt(n_layer=1), config=config, auto=shardwise.AutoValues(lr=1e-3))
    assert engine.config.zero.reduce_bucket_size == 32 * 32
    engine.close()
