"""DeepSpeed's learning-rate schedules as torch `LRScheduler`s, with DeepSpeed's parameter names,
defaults and lr sequences (DeepSpeed 0.19 `runtime/lr_schedules.py`; the tests compare the two).

Every schedule is a closed-form function of the batch iteration `it`. DeepSpeed starts at it = -1
(the lr set at construction) and each `step()` advances it by one; torch's `LRScheduler` counts
`last_epoch` from 0 at construction, so here ``it = last_epoch - 1``. Step once per optimizer step.
Values given as a list set one value per param group, as in DeepSpeed.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

logger = logging.getLogger(__name__)

WarmupType = Literal["log", "linear"]

PerGroup = float | list[float] | tuple[float, ...]
"""A value for every param group, or a list (tuple) of one value per group."""


def per_group(optimizer: Optimizer, value: PerGroup, name: str) -> list[float]:
    """One value per param group: a scalar is repeated, a list must have one entry per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name}: expected {groups} values (one per param group), got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * groups


def _positive_int(value: Any, name: str) -> int:
    # Integral floats (1e3) are accepted, as everywhere in the config.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _warmup_type(value: Any) -> WarmupType:
    # DeepSpeed silently falls back to "log" for an unknown type; a typo deserves an error.
    if value == "linear":
        return "linear"
    if value != "log":
        raise ValueError(f'warmup_type must be "log" or "linear", got {value!r}')
    return "log"


class _ClosedForm(LRScheduler):
    """Base: subclasses give `_lrs_at(it)`, the lr of every group at DeepSpeed iteration `it`."""

    def _lrs_at(self, it: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float | Tensor]:      # torch's type: a scheduler may hand out tensor lrs
        return list(self._lrs_at(self.last_epoch - 1))

    def _get_closed_form_lr(self) -> list[float]:
        return self._lrs_at(self.last_epoch - 1)


class _Warmup:
    """The warm-up ramp shared by WarmupLR, WarmupDecayLR and WarmupCosineLR: gamma in [0, 1)."""

    def __init__(self, num_steps: Any, kind: Any) -> None:
        # DeepSpeed uses at least 2 steps so that log(num_steps) > 0.
        self.num_steps = max(2, _positive_int(num_steps, "warmup_num_steps"))
        self.kind = _warmup_type(kind)
        self.inverse_log = 1.0 / math.log(self.num_steps)

    def gamma(self, it: int) -> float:
        """Fraction of the ramp done at iteration it < num_steps: log(it+1)/log(n) or it/n."""
        if self.kind == "log":
            return self.inverse_log * math.log(it + 1)
        return it / self.num_steps


class WarmupLR(_ClosedForm):
    """lr rises from warmup_min_lr to warmup_max_lr (default: the optimizer's lr) over
    warmup_num_steps steps ("log" or "linear" ramp), then stays at warmup_max_lr."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: PerGroup | None = None, warmup_num_steps: int = 1000,
                 warmup_type: WarmupType = "log") -> None:
        self.warmup = _Warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer)

    def _gamma(self, it: int) -> float:
        return self.warmup.gamma(it) if it < self.warmup.num_steps else 1.0

    def _lrs_at(self, it: int) -> list[float]:
        if it < 0:
            return list(self.min_lrs)
        gamma = self._gamma(it)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay from warmup_max_lr to 0 at total_num_steps."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int,
                 warmup_min_lr: PerGroup = 0.0, warmup_max_lr: PerGroup = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: WarmupType = "log") -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
        if self.total_num_steps < self.warmup.num_steps:
            logger.warning("total_num_steps %d is less than warmup_num_steps %d", total_num_steps, warmup_num_steps)

    def _gamma(self, it: int) -> float:
        if it < self.warmup.num_steps:
            return self.warmup.gamma(it)
        remaining = self.total_num_steps - it
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup.num_steps))


class WarmupCosineLR(_ClosedForm):
    """lr = optimizer lr * ratio: ratio rises from warmup_min_ratio to 1 over warmup_num_steps, then
    follows a half cosine down to cos_min_ratio at total_num_steps and stays there."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: WarmupType = "log") -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        self.warmup = _Warmup(warmup_num_steps, warmup_type)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        if self.total_num_steps < self.warmup.num_steps:
            logger.warning("total_num_steps %d is less than warmup_num_steps %d", total_num_steps, warmup_num_steps)
        super().__init__(optimizer)

    def ratio_at(self, it: int) -> float:
        if it < 0:
            return 0.0  # DeepSpeed: lr 0 before the first step
        if it < self.warmup.num_steps:
            return self.warmup_min_ratio + self.warmup.gamma(it) * (1.0 - self.warmup_min_ratio)
        done = it - self.warmup.num_steps + 1
        span = max(1, self.total_num_steps - self.warmup.num_steps)
        progress = min(1.0, done / span)  # held at the floor after total_num_steps
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs_at(self, it: int) -> list[float]:
        ratio = self.ratio_at(it)
        return [base * ratio for base in self.org_lrs]


class OneCycle(_ClosedForm):
    """1cycle: lr climbs cycle_min_lr -> cycle_max_lr over cycle_first_step_size steps, comes back over
    cycle_second_step_size (default: the same), then decays as cycle_min_lr / (1 + decay_lr_rate *
    n / decay_step_size) n steps after the cycle (no decay when either is 0). Stair counts > 0 move
    in that many flat steps per half. With cycle_momentum, Adam-style betas[0] moves inversely
    between cycle_max_mom and cycle_min_mom; as in DeepSpeed, betas[1] is set to 0.99, and optimizers
    without "betas" (e.g. SGD) keep their momentum (a warning says so)."""

    def __init__(self, optimizer: Optimizer, cycle_min_lr: PerGroup,
                 cycle_max_lr: PerGroup, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: PerGroup = 0.8, cycle_max_mom: PerGroup = 0.9,
                 decay_mom_rate: float = 0.0) -> None:
        self.first_size = float(cycle_first_step_size)
        self.second_size = float(cycle_second_step_size) if cycle_second_step_size is not None else self.first_size
        if self.first_size <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if self.second_size < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size}")
        self.total_size = self.first_size + self.second_size
        self.step_ratio = self.first_size / self.total_size
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            logger.warning("OneCycle: cycle_momentum is off because %s has no 'betas'", type(optimizer).__name__)
        self.min_moms = per_group(optimizer, cycle_min_mom, "cycle_min_mom") if self.cycle_momentum else []
        self.max_moms = per_group(optimizer, cycle_max_mom, "cycle_max_mom") if self.cycle_momentum else []
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        super().__init__(optimizer)

    def _scale(self, it: int) -> float:
        """Position in the current cycle as a fraction of the lr amplitude (0 at min, 1 at max)."""
        batch = it + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stairs
        if stairs > 0:
            # Quantise from the integer offset in the cycle, as DeepSpeed does, not from `scale`.
            offset = batch % self.total_size
            if offset <= self.first_size:
                position = offset * stairs / self.first_size
            else:
                position = (self.total_size - offset) * stairs / self.second_size
            scale = math.floor(position) / stairs
        return scale

    def _lrs_at(self, it: int) -> list[float]:
        if it < 0:
            return list(self.min_lrs)
        if it < self.total_size:
            scale = self._scale(it)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (it - self.total_size + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def momentum_at(self, it: int) -> list[float]:
        """betas[0] of every group at iteration `it`."""
        if it < 0:
            return list(self.min_moms)
        if it < self.total_size:
            scale = self._scale(it)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (it - self.total_size + 1) / self.decay_step_size
        return [hi * factor for hi in self.max_moms]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, momentum in zip(self.optimizer.param_groups, self.momentum_at(self.last_epoch - 1)):
                group["betas"] = (momentum, 0.99)


class LRRangeTest(_ClosedForm):
    """LR range test: lr = lr_range_test_min_lr * (1 + lr_range_test_step_rate * it / step_size),
    continuous or (staircase) in whole steps of lr_range_test_step_size."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: PerGroup = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False) -> None:
        self.min_lrs = per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer)

    def _lrs_at(self, it: int) -> list[float]:
        interval = (it + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lo * (1 + self.step_rate * interval) for lo in self.min_lrs]


SCHEDULERS: dict[str, type[LRScheduler]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}
"""DeepSpeed's schedule names -> our implementations."""
