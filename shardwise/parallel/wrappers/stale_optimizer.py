"""An optimizer built before `fully_shard` fails loudly at its first step instead of stepping nothing.

`fully_shard` hands the module new parameter objects (DTensors over this rank's rows, `sharded_params.py`); the
objects the module held before stay behind as the ZeRO-3 unit's inner parameters, whose `.grad` the runtime
clears after each reduction. An optimizer built on `model.parameters()` before wrapping holds those inner
objects, finds no gradient on them and silently changes nothing (FSDP2's trap too). The inner objects that were
replaced are marked, and one process-wide optimizer step pre-hook refuses an optimizer that holds any.

Cost on the normal path: each optimizer is scanned once (again only if its number of parameter groups changes);
every later step is one dictionary lookup.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardwise.errors import UserError

REPLACED_ATTR = "_shardwise_replaced_by_fully_shard"
"""Set on a parameter object that `fully_shard` replaced in its module by a DTensor parameter."""

_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
"""Optimizer -> its number of parameter groups when it was found clean."""
_installed = False


def mark_replaced(inner: Iterable[nn.Parameter], shown: Iterable[nn.Parameter]) -> None:
    """Mark the inner parameters that the module no longer holds (their shown parameter is another object) and
    make sure the step check is installed."""
    global _installed
    for p, s in zip(inner, shown):
        if s is not p:
            setattr(p, REPLACED_ATTR, True)
    if not _installed:
        register_optimizer_step_pre_hook(_refuse_replaced_parameters)
        _installed = True


def _refuse_replaced_parameters(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    groups = optimizer.param_groups
    if _checked.get(optimizer) == len(groups):
        return
    stale = sum(1 for g in groups for p in g["params"] if getattr(p, REPLACED_ATTR, False))
    if stale:
        raise UserError(f"{type(optimizer).__name__}.step(): {stale} of its parameters were replaced by "
                        f"fully_shard (the model now holds DTensor parameters), so this step would change nothing: "
                        f"build the optimizer after fully_shard(model), on model.parameters()")
    _checked[optimizer] = len(groups)
