"""DeepSpeed's `deepspeed.utils.timer.ThroughputTimer` import path and members: `engine.tput_timer`, the samples per
second of training, timed from a forward's start (`start()`) to the step that ends its micro-batch (`stop()`).

    timer.start()                      a micro-batch begins (the engine's forward)
    timer.stop(global_step=boundary)   it ends (the engine's step); `boundary`: the global batch ends too
    timer.avg_samples_per_sec()        batch_size / mean seconds per global step, over the steps timed

The first `start_step` global steps (2: warm-up, allocations) are counted but not timed, as in DeepSpeed;
`total_elapsed_time` sums the timed micro-batches, `step_elapsed_time` those of the global step in progress.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


class ThroughputTimer:
    """DeepSpeed's public members, same names and meanings (see the module docstring). `logging_fn(line)`, when
    given, gets a line with the running and current samples per second every `steps_per_output` global steps."""

    def __init__(self, batch_size: int | None, start_step: int = 2, steps_per_output: int | None = None,
                 logging_fn: Callable[[str], None] | None = None, synchronized: bool = True):
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.logging_fn = logging_fn
        self.synchronized = synchronized
        self.initialized = False        # start() was called once
        self.started = False            # between a start() and its stop()
        self.start_time = 0.0           # time.time() of the last timed start(); 0 until timing begins
        self.end_time = 0.0
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            self._sync()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """Ends the micro-batch a start() began; without one (never started, or stopped already) a no-op."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self._sync()
            self.end_time = time.time()
            elapsed = self.end_time - self.start_time
            self.total_elapsed_time += elapsed
            self.step_elapsed_time += elapsed
            if global_step:
                if report_speed and self._reports_now():
                    assert self.logging_fn is not None      # _reports_now: one is set
                    current = self.batch_size / max(self.step_elapsed_time, 1e-12)
                    self.logging_fn(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step="
                                    f"{self.global_step_count}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}"
                                    f", CurrSamplesPerSec={current}")
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed global steps; -inf before any global step ended."""
        if self.global_step_count == 0:
            return float("-inf")
        timed = self.global_step_count - self.start_step
        if timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)

    def _reports_now(self) -> bool:
        return (self.logging_fn is not None and self.steps_per_output is not None
                and self.global_step_count % self.steps_per_output == 0)

    def _sync(self) -> None:
        # kernels still queued would be timed in the next interval instead of this one
        if self.synchronized and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
