"""DeepSpeed's monitoring and logging keys with DeepSpeed 0.19's defaults: the blocks "tensorboard", "csv_monitor",
"wandb", "comms_logger", "flops_profiler" and the top-level "steps_per_print" and "wall_clock_breakdown", as
`MonitoringConfig`, what `telemetry/` reads.

A block may be given and disabled (``"enabled": false``); its other keys are still checked.
"""

from __future__ import annotations

import os

from pydantic import Field

from shardwise.config.fields import Bool, DeepSpeedSection, Int, NonNegativeFloat, PositiveInt, Section, Str


class EventFilesConfig(DeepSpeedSection):
    """"tensorboard" (TensorBoard event files; needs the `tensorboard` package) and "csv_monitor" (one CSV file per
    logged tag): events written under output_path/job_name by global rank 0."""

    enabled: Bool = False
    output_path: Str = ""
    """Directory under which the job's directory is made; "" = the current directory."""
    job_name: Str = "DeepSpeedJobName"
    """The job's directory inside output_path."""

    @property
    def log_dir(self) -> str:
        return os.path.join(self.output_path, self.job_name)


class WandbConfig(DeepSpeedSection):
    """Weights & Biases run logged by global rank 0 (needs the `wandb` package; WANDB_MODE=offline works)."""

    enabled: Bool = False
    group: Str | None = None
    team: Str | None = None
    """The W&B entity."""
    project: Str = "deepspeed"


class CommsLoggerConfig(DeepSpeedSection):
    """A per-op summary of the collectives (from the communication ledger), printed on global rank 0."""

    enabled: Bool = False
    verbose: Bool = False
    """Also print every collective as it completes."""
    prof_all: Bool = True
    """Log every op; false = only the ops named in prof_ops."""
    prof_ops: tuple[Str, ...] = ()
    debug: Bool = False
    """Break each op's rows down by the process group that ran it."""

    def logs(self, op: str) -> bool:
        """Whether collectives named `op` are logged."""
        return self.enabled and (self.prof_all or op in self.prof_ops)


class FlopsProfilerConfig(Section):
    """A per-module profile (parameters, forward FLOPs, latency) of one training step, on global rank 0."""

    enabled: Bool = False
    recompute_fwd_factor: NonNegativeFloat = 0.0
    """Share of the forward recomputed in backward (activation checkpointing): the backward is counted as
    (2 + factor) forwards."""
    profile_step: Int = Field(1, ge=0)
    """The optimizer step (counted from 0) whose first micro-batch is profiled."""
    module_depth: Int = Field(-1, ge=-1)
    """Deepest module level shown; -1 = all."""
    top_modules: Int = Field(1, ge=1)
    """Modules shown per depth in the aggregated profile."""
    detailed: Bool = True
    """Also print the whole module tree."""
    output_file: Str | None = None
    """Write the profile to this file instead of standard output."""


class MonitoringConfig(Section):
    """The monitoring keys, all at the top level of the config (`ConfigModel` inherits them); what the training
    monitor reads."""

    tensorboard: EventFilesConfig = Field(default_factory=EventFilesConfig)
    csv_monitor: EventFilesConfig = Field(default_factory=EventFilesConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    steps_per_print: PositiveInt | None = None
    """Log step, lr and momentum (and the timers and communication summary when on) every this many steps."""
    wall_clock_breakdown: Bool = False
    """Time forward, backward and the optimizer step, and print the breakdown."""

    @property
    def writes_events(self) -> bool:
        """Any event writer on (DeepSpeed's `monitor.enabled`)."""
        return self.tensorboard.enabled or self.csv_monitor.enabled or self.wandb.enabled
