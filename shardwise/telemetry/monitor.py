"""The engine's monitor: DeepSpeed's monitors, progress lines, wall-clock breakdown, comms logger and flops
profiler behind the few calls the engine makes.

    with monitor.forward(steps):    ...       # times the forward; profiles it at flops_profiler.profile_step
    with monitor.timed(name):       ...       # backward phases and the step (`timers.py` names)
    monitor.observe_loss(loss)                # each micro-batch loss engine.backward saw
    monitor.after_step(steps)                 # once per optimizer step, after the counters moved
    with monitor.global_batch(steps) as b: b.loss = ...    # engine.train_batch: the agreed loss

`steps` is the engine's step driver, read through `StepProgress`.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch

from shardwise.comm.ledger import CommLedger
from shardwise.config.monitoring import MonitoringConfig
from shardwise.telemetry.comms_logger import CommsLogger, print_line
from shardwise.telemetry.events import EventWriters
from shardwise.telemetry.flops_profiler import FlopsProfiler
from shardwise.telemetry.timers import (
    BACKWARD, BACKWARD_ALLREDUCE, BACKWARD_INNER, FORWARD, STEP, PhaseTimers, breakdown_line,
)

from shardwise.config.batch import BatchSizes

# DeepSpeed's monitor tags for the timers (milliseconds of one optimizer step).
_TIMER_TAGS = ((FORWARD, "Train/Samples/elapsed_time_ms_forward"),
               (BACKWARD, "Train/Samples/elapsed_time_ms_backward"),
               (BACKWARD_INNER, "Train/Samples/elapsed_time_ms_backward_inner"),
               (BACKWARD_ALLREDUCE, "Train/Samples/elapsed_time_ms_backward_allreduce"),
               (STEP, "Train/Samples/elapsed_time_ms_step"))


class StepProgress(Protocol):
    """What the monitor reads of the training progress (the engine's step driver): the counters, the lr and the
    loss scale."""

    global_steps: int
    global_samples: int
    skipped_steps: int
    batch: BatchSizes

    @property
    def loss_scale(self) -> float: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def get_lr(self) -> list[float]: ...


@dataclass
class BatchResult:
    """What `engine.train_batch` hands the monitor: the loss agreed over micro-batches and data-parallel ranks."""

    loss: float | None = None


def momentum_of(group: dict[str, Any]) -> Any:
    """DeepSpeed's `mom` of a param group: Adam-style betas, else SGD/RMSprop momentum, else 0.0."""
    if "betas" in group:
        return tuple(group["betas"])
    return group.get("momentum", 0.0)


class TrainingMonitor:
    """What is printed goes to standard output on global rank 0 only, with DeepSpeed's wording:
    `[Rank 0] step=10, skipped=0, lr=[...], mom=[...]` every `steps_per_print` steps, and, when asked for,
    `[Rank 0] time (ms) | fwd: ...` and the communication summary every `steps_per_print` steps (every step
    when steps_per_print is unset, as DeepSpeed prints its timers), and the flops profile once."""

    def __init__(self, section: MonitoringConfig, *, module: torch.nn.Module, ledger: CommLedger,
                 device: torch.device, global_rank: int, world_size: int, dp_size: int, mp_size: int,
                 micro_batch: int, scales_loss: bool, profiles: bool | None = None,
                 pipeline_stage: tuple[int, int] | None = None, module_names: dict[str, str] | None = None):
        """`profiles`: this rank prints a flops profile (default: global rank 0; under a pipeline the first rank
        of each stage, `pipeline_stage` = (stage, stages), whose modules `module_names` names as in the full
        model)."""
        self.section = section
        self.global_rank = global_rank
        self._shape = {"world_size": world_size, "dp_size": dp_size, "mp_size": mp_size, "micro_batch": micro_batch}
        self._scales_loss = scales_loss
        self._out = print_line(lambda: sys.stdout)
        self.events = EventWriters.build(section, global_rank=global_rank)
        self.timers = PhaseTimers(enabled=section.wall_clock_breakdown or section.flops_profiler.enabled,
                                  device=device)
        self.comms = (CommsLogger(section.comms_logger, ledger, global_rank=global_rank, out=self._out)
                      if section.comms_logger.enabled else None)
        profiles = global_rank == 0 if profiles is None else profiles
        self.flops = (FlopsProfiler(section.flops_profiler, module, device=device, stage=pipeline_stage,
                                    names=module_names)
                      if section.flops_profiler.enabled and profiles else None)
        self._flops_reported = False
        self.progress_lines = True
        """DeepSpeed's two progress lines every steps_per_print steps; off where the caller prints its own line per
        interval (`shardwise train`), so an interval shows one line, not three with different throughputs."""
        self._losses: list[torch.Tensor] = []
        self._in_batch = 0
        self._window_steps = 0             # optimizer steps since the last timers/comms print
        self._batch_seconds = 0.0          # train_batch wall time since the last progress print
        self._batch_samples = 0
        self._batch_count = 0

    @property
    def _print_every(self) -> int:
        return self.section.steps_per_print or 1

    def _say(self, line: str) -> None:
        if self.global_rank == 0:
            self._out(line)

    # -- what the engine calls ----------------------------------------------------------------------
    @contextmanager
    def forward(self, steps: StepProgress) -> Iterator[None]:
        """A training forward: timed, and profiled if it is the first of flops_profiler.profile_step."""
        profile = self.flops is not None and self.flops.wants(steps.global_steps)
        with self.timers.timed(FORWARD):
            if profile:
                assert self.flops is not None
                with self.flops.profiling():
                    yield
            else:
                yield

    @contextmanager
    def stage_forwards(self, steps: StepProgress) -> Iterator[Callable[[int], Any] | None]:
        """A pipeline step: yields what wraps the stage's forward of micro-batch m (at flops_profiler.profile_step
        the first micro-batch's forwards are profiled), or None when nothing watches the forwards."""
        if self.flops is None or not self.flops.wants(steps.global_steps):
            yield None
            return
        with self.flops.session() as session:
            yield lambda m: session.counting() if m == 0 else nullcontext()

    def timed(self, name: str) -> Any:
        return self.timers.timed(name)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch loss from engine.backward; kept on its device (no sync) until the step writes it."""
        if self.events.enabled and not self._in_batch:
            self._losses.append(loss.detach().float())

    @contextmanager
    def global_batch(self, steps: StepProgress) -> Iterator[BatchResult]:
        """engine.train_batch: its own loss (agreed over ranks) replaces the micro-batch losses of backward."""
        result = BatchResult()
        self._in_batch += 1
        start = time.perf_counter()
        try:
            yield result
        finally:
            self._in_batch -= 1
        self._batch_seconds += time.perf_counter() - start
        self._batch_samples += steps.batch.train_batch_size
        self._batch_count += 1
        if result.loss is None:
            return
        self.events.write([("Train/Samples/train_loss", result.loss, steps.global_samples)])
        spp = self.section.steps_per_print
        if spp and steps.global_steps % spp == 0:
            iter_s = self._batch_seconds / self._batch_count
            if self.progress_lines:
                self._say(f"steps: {steps.global_steps} loss: {result.loss:0.4f} iter time (s): {iter_s:0.3f} "
                          f"samples/sec: {self._batch_samples / self._batch_seconds:0.3f}")
            self._batch_seconds, self._batch_samples, self._batch_count = 0.0, 0, 0

    def eval_loss(self, steps: StepProgress, loss: float) -> None:
        self.events.write([("Train/Samples/eval_loss", loss, steps.global_samples)])

    def after_step(self, steps: StepProgress) -> None:
        """Once per optimizer step, after steps.global_steps and global_samples counted it."""
        step = steps.global_steps
        step_ms = self.timers.end_step()
        self._window_steps += 1
        if self.events.enabled:
            self.events.write(self._step_events(steps, step_ms))
        self._losses = []
        spp = self.section.steps_per_print
        if spp and step % spp == 0 and self.progress_lines:
            lr = steps.get_lr()
            mom = [momentum_of(g) for g in steps.optimizer.param_groups]
            self._say(f"[Rank 0] step={step}, skipped={steps.skipped_steps}, lr={lr}, mom={mom}")
        if step % self._print_every == 0:
            if self.section.wall_clock_breakdown:
                line = breakdown_line(self.timers, self._window_steps)
                if line is not None:
                    self._say(f"[Rank 0] {line}")
            self.timers.reset()
            if self.comms is not None:
                self.comms.log_summary(self._window_steps)
            self._window_steps = 0
        if self.flops is not None and self.flops.profile is not None and not self._flops_reported:
            self._flops_reported = True
            lines = self.flops.report_lines(step=step - 1, bwd_ms=self.timers.last_ms.get(BACKWARD),
                                            step_ms=self.timers.last_ms.get(STEP), **self._shape)
            self.flops.write_report(lines, self._out)

    def _step_events(self, steps: StepProgress, step_ms: dict[str, float]) -> list[tuple[str, float, int]]:
        x = steps.global_samples
        events: list[tuple[str, float, int]] = []
        if self._losses:
            # A loop of engine(batch) / backward / step: this rank's mean micro-batch loss (as DeepSpeed logs it).
            events.append(("Train/Samples/train_loss", float(torch.stack(self._losses).mean()), x))
        events.append(("Train/Samples/lr", steps.get_lr()[0], x))
        if self._scales_loss:
            events.append(("Train/Samples/loss_scale", steps.loss_scale, x))
        if self.section.wall_clock_breakdown or self.section.flops_profiler.enabled:
            events += [(tag, step_ms[name], x) for name, tag in _TIMER_TAGS if name in step_ms]
        return events

    def close(self) -> None:
        self.events.close()
