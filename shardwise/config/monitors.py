"""Schema of DeepSpeed's monitoring and logging blocks: "tensorboard", "csv_monitor", "wandb",
"comms_logger" and "flops_profiler", with DeepSpeed 0.19's keys and defaults (`monitor/config.py`,
`comm/config.py`, `profiling/config.py`).

A block may be given and disabled (``"enabled": false``); its other keys are still checked.
"""

from __future__ import annotations

from pydantic import Field

from shardwise.config.fields import Bool, Int, NonNegativeFloat, Section, Str


class TensorBoardSection(Section):
    """TensorBoard event files written by global rank 0 (needs the `tensorboard` package)."""

    enabled: Bool = False
    output_path: Str = ""
    """Directory under which the job's directory is made; "" = the current directory."""
    job_name: Str = "DeepSpeedJobName"
    """The job's directory inside output_path."""


class CSVMonitorSection(Section):
    """One CSV file per logged tag, written by global rank 0."""

    enabled: Bool = False
    output_path: Str = ""
    """Directory under which the job's directory is made; "" = the current directory."""
    job_name: Str = "DeepSpeedJobName"


class WandbSection(Section):
    """Weights & Biases run logged by global rank 0 (needs the `wandb` package; WANDB_MODE=offline works)."""

    enabled: Bool = False
    group: Str | None = None
    team: Str | None = None
    """The W&B entity."""
    project: Str = "deepspeed"


class CommsLoggerSection(Section):
    """A per-op summary of the collectives (from the communication ledger), printed on global rank 0."""

    enabled: Bool = False
    verbose: Bool = False
    """Also print every collective as it completes."""
    prof_all: Bool = True
    """Log every op; false = only the ops named in prof_ops."""
    prof_ops: list[Str] = Field(default_factory=list)
    debug: Bool = False
    """Break each op's rows down by the process group that ran it."""


class FlopsProfilerSection(Section):
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
