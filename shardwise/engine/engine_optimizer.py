"""`engine.optimizer`: the optimizer the engine steps, with the members DeepSpeed's optimizer wrappers carry.

DeepSpeed's `engine.optimizer` is, under fp16, bf16 or ZeRO, a wrapper that integrations read to tell whether the
last update was skipped: Accelerate's `step_was_skipped` (and through it Hugging Face's Trainer) reads
`engine.optimizer.overflow`; scripts read `cur_scale` / `loss_scale` for the fp16 scale in force. At ZeRO stage 0
in fp32 it is the client's own optimizer object, and DeepSpeed's tests check that identity.

Ours is always the torch optimizer that steps this rank's tensors (the client's own object where the engine steps
the client's parameters), given those members by swapping its class for a subclass that adds them, the way
`fully_shard` swaps a module's class: the object, its `isinstance` against `AdamW` or the client's class, its
`param_groups`, `state`, `state_dict`, `zero_grad` and `step` all stay what they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from shardwise.engine.step import TrainingSteps


class DeepSpeedOptimizerMembers:
    """The members added to the engine's optimizer:

        overflow        whether the latest update (gradient-accumulation boundary) was skipped on inf/nan
        cur_scale       the loss scale in force (1.0 without fp16); settable, as DeepSpeed's
        loss_scale      the same (a property on DeepSpeed's optimizers; the engine's `loss_scale()` is the config's)
        optimizer       the torch optimizer itself (DeepSpeed's wrappers name their inner one so)

    `step()` is the optimizer's plain step: the engine's update (unscale, overflow skip, clip) is `engine.step()`."""

    _shardwise_steps: "TrainingSteps"

    @property
    def overflow(self) -> bool:
        return self._shardwise_steps.overflow

    @property
    def cur_scale(self) -> float:
        return self._shardwise_steps.updater.scaler.cur_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._shardwise_steps.updater.scaler.cur_scale = float(value)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.cur_scale = value

    @property
    def optimizer(self) -> Any:
        return self


_SUBCLASSES: dict[tuple[type, frozenset[str]], type] = {}
_MEMBERS = ("overflow", "cur_scale", "loss_scale", "optimizer")


def with_deepspeed_members(optimizer: torch.optim.Optimizer, steps: "TrainingSteps") -> torch.optim.Optimizer:
    """`optimizer` itself, its class swapped for one that adds `DeepSpeedOptimizerMembers` (made once per class).

    A member the optimizer already has (a wrapper's own `optimizer`, an fp16 optimizer's `cur_scale`) is left as it
    is: the added properties would otherwise shadow the optimizer's own attributes and break its step."""
    if not getattr(type(optimizer), "_shardwise_members", False):
        cls = type(optimizer)
        added = frozenset(name for name in _MEMBERS
                          if not hasattr(cls, name) and name not in optimizer.__dict__)
        swapped = _SUBCLASSES.get((cls, added))
        if swapped is None:
            namespace: dict[str, object] = {name: DeepSpeedOptimizerMembers.__dict__[name] for name in added}
            namespace.update({"__module__": cls.__module__, "_shardwise_members": True,
                              "__doc__": DeepSpeedOptimizerMembers.__doc__})
            swapped = type(cls.__name__, (cls,), namespace)
            _SUBCLASSES[(cls, added)] = swapped
        optimizer.__class__ = swapped
    optimizer.__dict__["_shardwise_steps"] = steps
    return optimizer
