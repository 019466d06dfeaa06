"""Dtype policy and loss scaling.

Mixed precision follows DeepSpeed's stage-0 optimizers: the model's parameters and gradients live in the
low-precision dtype (bf16 or fp16), the optimizer steps fp32 master copies, and the updated masters are cast
back into the model. fp16 multiplies the loss by a scale so small gradients survive the cast; the scale is
dynamic by default and moves exactly as DeepSpeed's DynamicLossScaler moves it (halve on overflow after
`hysteresis` overflows, double after `loss_scale_window` clean steps), and an overflowing step is skipped.
"""

from __future__ import annotations

import torch

from shardwise.config.resolved import DType, PrecisionConfig
from shardwise.errors import UserError

__all__ = ["DType", "DynamicLossScaler", "LossScaleAtMinimum", "LossScaler", "grads_have_inf_or_nan",
           "make_loss_scaler", "nonfinite_flag"]


class LossScaleAtMinimum(UserError):
    """Raised when an fp16 step overflows while the loss scale already sits at `min_loss_scale`."""


class LossScaler:
    """No scaling (fp32 and bf16): scale 1, never skips."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        """Static scaling still skips an overflowing step, but never changes the scale."""

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state: dict) -> None:
        self.cur_scale = state["cur_scale"]


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic scaler, same arithmetic:

    * overflow: if `hysteresis` overflows have been absorbed (cur_hysteresis == 1), halve the scale (never
      below min_scale; an overflow AT min_scale is an error), else spend one unit of hysteresis.
    * clean step: every `scale_window` clean iterations since the last overflow, double the scale (and
      refill hysteresis); with consecutive_hysteresis the hysteresis is refilled after every clean step.
    """

    dynamic = True

    def __init__(self, *, init_scale: float, scale_window: int, min_scale: float, hysteresis: int,
                 consecutive_hysteresis: bool = False, raise_error_at_min_scale: bool = True):
        super().__init__(init_scale)
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.delayed_shift = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimum(
                        f"fp16 gradients overflowed with the loss scale already at fp16.min_loss_scale = "
                        f"{self.min_scale:g}: training has diverged or the model needs bf16/fp32. Lower "
                        f"fp16.min_loss_scale, lower the learning rate, or use \"bf16\": {{\"enabled\": true}}")
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter, "cur_hysteresis": self.cur_hysteresis,
                "last_overflow_iter": self.last_overflow_iter}

    def load_state_dict(self, state: dict) -> None:
        self.cur_scale = state["cur_scale"]
        self.cur_iter = state["cur_iter"]
        self.cur_hysteresis = state["cur_hysteresis"]
        self.last_overflow_iter = state["last_overflow_iter"]


def grads_have_inf_or_nan(grads: list[torch.Tensor]) -> bool:
    """One host sync for all tensors. Each tensor's float64 sum is inf/nan iff the tensor holds an inf/nan (no
    finite fp32/bf16/fp16 values overflow float64 by adding up), and a sum runs vectorized where isfinite().all()
    does not: ~30x faster on the CPU (0.6 ms vs 23 ms for the 1.9M gradients of the tiny GPT)."""
    if not grads:
        return False
    sums = torch.stack([g.sum(dtype=torch.float64) for g in grads])
    return not bool(sums.isfinite().all())


def nonfinite_flag(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-dim float64 on `device`: 1 if any gradient holds inf/nan, else 0; computed there, never read here."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    flags = torch.stack([torch.logical_not(torch.isfinite(g).all()).to(device) for g in grads])
    return flags.any().to(torch.float64)


def make_loss_scaler(precision: PrecisionConfig) -> LossScaler:
    """The scaler a config asks for: none for fp32/bf16, a fixed or DeepSpeed's dynamic scale for fp16."""
    if precision.dtype != DType.FP16:
        return LossScaler(1.0)
    if not precision.dynamic_loss_scale:
        return LossScaler(precision.static_loss_scale)
    return DynamicLossScaler(init_scale=2.0 ** precision.initial_scale_power,
                             scale_window=precision.loss_scale_window, min_scale=precision.min_loss_scale,
                             hysteresis=precision.hysteresis,
                             consecutive_hysteresis=precision.consecutive_hysteresis)
