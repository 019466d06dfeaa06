"""Wall-clock timers of the engine's phases, under DeepSpeed's timer names.

Each timer accumulates milliseconds until it is read and reset, so a print every N steps shows what those N steps
spent. Timers are only switched on when a config asks for them: on CUDA they synchronise the device (`PhaseTimers`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

FORWARD = "fwd"                        # engine.forward (training micro-batches)
BACKWARD = "bwd"                       # engine.backward, all of it
BACKWARD_INNER = "bwd_inner"           # autograd's backward inside it
BACKWARD_ALLREDUCE = "bwd_allreduce"   # the gradient synchronisation after autograd (what overlap did not hide)
STEP = "step"                          # engine.step on the accumulation boundary (unscale, clip, optimizer, lr)

# The order of DeepSpeed's timers line.
BREAKDOWN = (FORWARD, BACKWARD, BACKWARD_INNER, BACKWARD_ALLREDUCE, STEP)


class PhaseTimers:
    """Named accumulating timers. `enabled=False` makes `timed` a no-op (nothing is synchronised). On CUDA the
    device is synchronised at both ends of a timed region: kernels run asynchronously, and a host clock alone
    would time their launch."""

    def __init__(self, *, enabled: bool, device: torch.device):
        self.enabled = enabled
        self._sync = device.type == "cuda"
        self._device = device
        self._total_ms: dict[str, float] = {}
        self._step_ms: dict[str, float] = {}
        self.last_ms: dict[str, float] = {}
        """Each timer's most recent interval, kept across resets (the flops profiler reads it)."""

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = self._now()
        try:
            yield
        finally:
            elapsed = (self._now() - start) * 1e3
            self._total_ms[name] = self._total_ms.get(name, 0.0) + elapsed
            self._step_ms[name] = self._step_ms.get(name, 0.0) + elapsed
            self.last_ms[name] = elapsed

    def total_ms(self, name: str) -> float | None:
        """Milliseconds accumulated since the last reset; None if the timer never ran."""
        return self._total_ms.get(name)

    def end_step(self) -> dict[str, float]:
        """Milliseconds per timer since the previous call (one optimizer step's worth), then start over."""
        step, self._step_ms = self._step_ms, {}
        return step

    def reset(self, names: tuple[str, ...] | None = None) -> None:
        for name in names if names is not None else tuple(self._total_ms):
            self._total_ms.pop(name, None)


def breakdown_line(timers: PhaseTimers, steps: int, names: tuple[str, ...] = BREAKDOWN) -> str | None:
    """DeepSpeed's timers line, `time (ms) | fwd: 12.34 | bwd: ...`, each figure the mean per optimizer step
    over the last `steps` steps (a timer that never ran is left out); None when none ran."""
    parts = [f"{name}: {ms / steps:.2f}" for name in names if (ms := timers.total_ms(name)) is not None]
    return "time (ms) | " + " | ".join(parts) if parts else None
