"""The monitoring sections of the frozen config: event writers (tensorboard, csv, wandb), the comms logger and
the flops profiler, as `telemetry/` reads them. Part of the internal config form (`resolved.py`); no torch
import here either."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EventFilesConfig:
    """"tensorboard" and "csv_monitor": events written under output_path/job_name by global rank 0."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"

    @property
    def log_dir(self) -> str:
        return os.path.join(self.output_path, self.job_name)


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


@dataclass(frozen=True, kw_only=True)
class CommsLoggerConfig:
    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: tuple[str, ...] = ()
    debug: bool = False

    def logs(self, op: str) -> bool:
        """Whether collectives named `op` are logged."""
        return self.enabled and (self.prof_all or op in self.prof_ops)


@dataclass(frozen=True, kw_only=True)
class FlopsProfilerConfig:
    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None


@dataclass(frozen=True, kw_only=True)
class MonitoringConfig:
    """What the training monitor reads: the event writers, the profilers and how often to print."""

    tensorboard: EventFilesConfig = EventFilesConfig()
    csv_monitor: EventFilesConfig = EventFilesConfig()
    wandb: WandbConfig = WandbConfig()
    comms_logger: CommsLoggerConfig = CommsLoggerConfig()
    flops_profiler: FlopsProfilerConfig = FlopsProfilerConfig()
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False

    @property
    def writes_events(self) -> bool:
        """Any event writer on (DeepSpeed's `monitor.enabled`)."""
        return self.tensorboard.enabled or self.csv_monitor.enabled or self.wandb.enabled
