"""`engine.optimizer`: the optimizer the engine steps, with the members DeepSpeed's optimizer wrappers carry.

DeepSpeed's `engine.optimizer` is a wrapper (its ZeRO, fp16 or bf16 optimizer) that integrations read to tell
whether the last update was skipped: Accelerate's `step_was_skipped` (and through it Hugging Face's Trainer)
reads `engine.optimizer.overflow`; scripts read `cur_scale` / `loss_scale` for the fp16 scale in force. Ours is
the torch optimizer that steps this rank's tensors (fp32 masters, ZeRO shards), wrapped so that it also answers
those members, while it stays a `torch.optim.Optimizer` (an LR scheduler can be built on it) whose
`param_groups`, `state`, `state_dict`, `zero_grad` and `step` are the wrapped optimizer's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from shardwise.engine.step import TrainingSteps


class EngineOptimizer(torch.optim.Optimizer):
    """The wrapped optimizer's state and methods, plus DeepSpeed's wrapper members:

        overflow        whether the latest update (gradient-accumulation boundary) was skipped on inf/nan
        cur_scale       the loss scale in force (1.0 without fp16); settable, as DeepSpeed's
        loss_scale      the same (a property on DeepSpeed's optimizers; the engine's `loss_scale()` is the config's)
        optimizer       the wrapped torch optimizer (DeepSpeed's wrappers name theirs so)

    `step()` is the wrapped optimizer's plain step: the engine's update (unscale, overflow skip, clip) is
    `engine.step()`. Torch's `Optimizer.__init__` is not run: every state member is the wrapped optimizer's."""

    # Set by __init__ through object.__setattr__: the class's properties below forward to them.
    optimizer: torch.optim.Optimizer
    _steps: "TrainingSteps"

    def __init__(self, optimizer: torch.optim.Optimizer, steps: "TrainingSteps"):
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "_steps", steps)

    # -- DeepSpeed's members ------------------------------------------------------------------------------
    @property
    def overflow(self) -> bool:
        return self._steps.overflow

    @property
    def cur_scale(self) -> float:
        return self._steps.updater.scaler.cur_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._steps.updater.scaler.cur_scale = float(value)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.cur_scale = value

    # -- the wrapped optimizer's state (torch's Optimizer keeps these as instance attributes) ----------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        # Anything else (hook registries, an optimizer's own members) is the wrapped optimizer's.
        if name in ("optimizer", "_steps"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.optimizer!r})"
