"""The loss inside what a model returns: a scalar tensor, or a Hugging Face `ModelOutput` (and any object or dict)
carrying `.loss` / `["loss"]`. The engine's backward, `train_batch`, `eval_batch` and the pipeline's last stage
all read a micro-batch's loss through `loss_of`, so a transformers model trains and evaluates with its own output."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def loss_of(output: Any) -> Any:
    """`output` when it is a tensor; else its `loss` (attribute or key) when that is a tensor; else `output`
    unchanged, for the caller to refuse with its own message."""
    if torch.is_tensor(output):
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if torch.is_tensor(loss) else output
