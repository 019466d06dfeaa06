"""Reference models: a decoder-only GPT, its config and named presets.

    from shardwise.models import GPT, gpt_config
    model = GPT(gpt_config("tiny", positions="rotary"))
    llama = GPT(gpt_config("llama-tiny"))        # RMSNorm, SwiGLU, rotary, grouped-query attention

The config, presets and pure counts (`presets.py`) import without torch; the torch modules (`gpt.py`)
are loaded on first use, so the planner can size our GPT without importing torch. How these models and Hugging
Face's are parallelized (tensor-parallel plans, attention under recomputation) is in `parallelize.py`.
"""

from __future__ import annotations

import importlib
from typing import Any

from shardwise.models.presets import (
    PRESETS, GPTConfig, MLPKind, Norm, Positions, gpt_config, gpt_flops_per_token, gpt_num_params,
)

_TORCH_EXPORTS = ("GPT", "IGNORE_INDEX", "Attention", "Block", "Embedding", "Head", "MLP")

__all__ = [
    "GPT", "GPTConfig", "PRESETS", "Positions", "Norm", "MLPKind", "gpt_config", "gpt_num_params",
    "gpt_flops_per_token",
    "Attention", "Block", "Embedding", "Head", "MLP", "IGNORE_INDEX",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_EXPORTS:
        return getattr(importlib.import_module("shardwise.models.gpt"), name)
    raise AttributeError(f"module 'shardwise.models' has no attribute {name!r}")
