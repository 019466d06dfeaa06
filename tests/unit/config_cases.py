"""Helpers shared by the config tests (test_config.py, test_config_batch.py)."""

from __future__ import annotations

import os

import pytest

from shardwise.config import ConfigError, EngineConfig, load_config

BASE = {"train_batch_size": 32}


def deepspeed(module: str):
    """A DeepSpeed module as the oracle (on the CPU accelerator), or skip when DeepSpeed is absent."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip(module)


def load(extra: dict, dp_size: int = 4) -> EngineConfig:
    return load_config({**BASE, **extra}, dp_size=dp_size)


def error_of(config: dict, dp_size: int = 4) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(config, dp_size=dp_size)
    return info.value
