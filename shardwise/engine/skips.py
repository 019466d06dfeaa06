"""Steps skipped for inf/nan: which are skipped, how they are reported, and when the run gives up.

The skip itself is the updater's overflow verdict (`parallel/update.py`), agreed by every rank that holds part
of the model, so every rank counts the same skips and raises together. This module decides what the engine does
around it: seed backward so that an inf/nan loss always reaches the verdict, say each skip in one line, and end
the run with `NonFiniteError` after `nonfinite.max_consecutive_skips` in a row.
"""

from __future__ import annotations

import logging

import torch

from shardwise.config.resolved import DType, EngineConfig
from shardwise.errors import NonFiniteError

logger = logging.getLogger("shardwise.engine.engine")


def skips_nonfinite_steps(config: EngineConfig) -> bool:
    """fp16 always skips a step with inf/nan gradients, bf16 with bf16.check_grad_overflow, fp32 with
    nonfinite.skip_step."""
    return config.precision.checks_overflow or (config.precision.dtype is DType.FP32 and config.nonfinite.skip_step)


def consecutive_limit(config: EngineConfig) -> int:
    """Skipped steps in a row that end the run (0: never). Dynamic fp16 scaling first needs up to hysteresis
    overflows per halving to bring its initial scale down to 1: those are not divergence, and are allowed on top."""
    limit = config.nonfinite.max_consecutive_skips
    if limit and config.precision.dynamic_loss_scale:
        limit += config.precision.hysteresis * max(config.precision.initial_scale_power, 0)
    return limit


class SkipGuard:
    """The engine's: `seed` for every backward, `after_step` after every optimizer step."""

    def __init__(self, config: EngineConfig, global_rank: int):
        self.enabled = skips_nonfinite_steps(config)
        self.limit = consecutive_limit(config)
        self.configured = config.nonfinite.max_consecutive_skips
        self.global_rank = global_rank
        self.consecutive = 0
        self.last_loss: torch.Tensor | None = None

    def seed(self, scaled: torch.Tensor, loss: torch.Tensor) -> torch.Tensor | None:
        """The gradient backward starts from: 1 for a finite loss (bitwise torch's own seed), nan for an inf/nan
        one, without a host sync. An inf loss can have finite gradients (cross-entropy of a -inf logit); seeded
        with nan, its micro-batch's gradients are nan, the all-reduce spreads them, and the verdict every rank
        agrees on skips the step on every replica. None (torch's seed) when such steps are not skipped."""
        self.last_loss = loss.detach()
        if not self.enabled:
            return None
        return torch.ones_like(scaled) + scaled.detach() * 0.0

    def after_step(self, applied: bool, *, step: int, lr: float, loss_scale: float) -> None:
        """Count; on a skip one warning line (global rank 0), and `NonFiniteError` at the limit."""
        if applied:
            self.consecutive = 0
            return
        self.consecutive += 1
        loss = float(self.last_loss) if self.last_loss is not None else None
        what = (f"step {step} skipped: inf/nan gradients"
                + (f" (rank {self.global_rank}'s loss {loss:g})" if loss is not None else "")
                + f", lr {lr:g}, loss scale {loss_scale:g}; {self.consecutive} in a row")
        if self.global_rank == 0:
            logger.warning("shardwise: %s", what)
        if self.limit and self.consecutive >= self.limit:
            raise NonFiniteError(
                f"{what}: training has diverged or the data holds inf/nan. Lower the learning rate "
                f"(optimizer.params.lr, scheduler warmup_max_lr), keep gradient_clipping on, or check the data; the "
                f"limit is nonfinite.max_consecutive_skips = {self.configured} (0 = never stop)")
