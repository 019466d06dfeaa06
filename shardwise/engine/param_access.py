"""DeepSpeed's `deepspeed.utils` parameter accessors (`shardwise.utils`), under every ZeRO stage and with tensor
parallelism.

    safe_get_full_fp32_param(param)   the fp32 value the optimizer steps for `param`, whole
    safe_get_full_grad(param)         `param`'s gradient as the next step uses it, whole

Both are collective over the data-parallel group when its ranks hold shards (ZeRO 1-3): every dp rank calls
them, for the same parameters in the same order. "Whole" means the parameter this rank holds: under tensor
parallelism its TP slice (as DeepSpeed's, which assemble over dp only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shardwise.parallel.interfaces import FullValues

UPDATER_ATTR = "_shardwise_updater"
"""Attribute of each trained model parameter: the updater that steps it (set by `link_params`)."""


def link_params(updater: FullValues) -> None:
    """Point every parameter `updater` trains at it, so the functions here find their master and gradient."""
    for p in updater.model_params:
        setattr(p, UPDATER_ATTR, updater)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """A copy of `param`'s fp32 master value; None when no optimizer steps it (frozen, or not in the
    model_parameters given to `shardwise.initialize`), as in DeepSpeed. Difference: DeepSpeed also gives None for
    every parameter under stage 0 in fp32 or fp16 (no fp32 mapping exists there); here the fp32 value is given."""
    updater: FullValues | None = getattr(param, UPDATER_ATTR, None)
    return None if updater is None else updater.full_master(param)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """`param`'s whole gradient: fp32 assembled from the gradient shards under ZeRO, the dp-averaged `.grad`
    otherwise; None when it has none.

    Read it after the backward of the last micro-batch of a global batch and before `engine.step()`, which zeroes
    it. Under fp16 it is still multiplied by the loss scale (the step unscales it), as DeepSpeed's is."""
    updater: FullValues | None = getattr(param, UPDATER_ATTR, None)
    if updater is None:
        return param.grad    # DeepSpeed's fallback for a parameter it does not manage
    return updater.full_grad(param)
