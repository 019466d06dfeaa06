"""DeepSpeed's monitors: scalar events `(tag, value, x)` written to TensorBoard, CSV files and W&B.

Tags and the x-axis are DeepSpeed's: `Train/Samples/train_loss`, `Train/Samples/lr`,
`Train/Samples/loss_scale`, `Train/Samples/elapsed_time_ms_forward`, ... against the number of samples
trained so far (all data-parallel ranks together). Only global rank 0 builds writers; the other ranks
hold an empty `EventWriters` and write nothing.

Directories are `output_path/job_name` ("" puts the job's directory in the current directory). The CSV
monitor keeps one file per tag, named after the tag with "/" and " " made "_", whose first row is
`step,<last part of the tag>`.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

from shardwise.config.monitoring import EventFilesConfig, MonitoringConfig, WandbConfig
from shardwise.errors import UserError

Event = tuple[str, float, int]


def require_package(module: str, key: str, extra: str = "monitors", *, load: bool = True) -> Any:
    """Import `module` (or, with load=False, only find it), or stop with one line naming the config key that
    needs it and the extra to install."""
    try:
        if load:
            return importlib.import_module(module)
        if importlib.util.find_spec(module) is not None:
            return None
    except (ImportError, ValueError):      # ValueError: a module set to None in sys.modules
        pass
    raise UserError(f'"{key}": true needs the {module.split(".")[0]} package, which is not installed; '
                    f"pip install 'shardwise[{extra}]' (or set {key} to false)")


class EventWriter(Protocol):
    def write(self, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    """torch's SummaryWriter into `log_dir`; flushed after every batch of events, so a live TensorBoard
    (or a crashed run) sees each step."""

    def __init__(self, section: EventFilesConfig):
        require_package("tensorboard", "tensorboard.enabled")
        from torch.utils.tensorboard import SummaryWriter
        self.log_dir = section.log_dir
        os.makedirs(self.log_dir or ".", exist_ok=True)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def write(self, events: Sequence[Event]) -> None:
        for tag, value, x in events:
            self._writer.add_scalar(tag, value, x)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def csv_file_name(tag: str) -> str:
    """The CSV monitor's file for a tag: `Train/Samples/lr` -> `Train_Samples_lr.csv`."""
    return tag.replace("/", "_").replace(" ", "_") + ".csv"


class CSVWriter:
    """One CSV file per tag, appended to; the header is written when the file is new or empty."""

    def __init__(self, section: EventFilesConfig):
        self.log_dir = Path(section.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def write(self, events: Sequence[Event]) -> None:
        for tag, value, x in events:
            path = self.log_dir / csv_file_name(tag)
            fresh = not path.exists() or path.stat().st_size == 0
            with open(path, "a", newline="", encoding="utf-8") as f:
                out = csv.writer(f)
                if fresh:
                    out.writerow(["step", tag.rsplit("/", 1)[-1]])
                out.writerow([x, value])

    def close(self) -> None:
        """Every row is written and closed at once; nothing is held open."""


class WandbWriter:
    """A W&B run (project, group, entity = team) in the current directory's `wandb/`. With WANDB_MODE=offline
    nothing leaves the machine; `wandb sync` uploads the run later. W&B's own service process writes the run
    file: `close` ends the run, and the file is complete once that process is done (`wandb.teardown()`)."""

    def __init__(self, section: WandbConfig):
        self._wandb = require_package("wandb", "wandb.enabled")
        self.run = self._wandb.init(project=section.project, group=section.group, entity=section.team)

    def write(self, events: Sequence[Event]) -> None:
        for tag, value, x in events:
            self.run.log({tag: value}, step=x)

    def close(self) -> None:
        self.run.finish()


class EventWriters:
    """Fans each batch of events out to every writer the config enabled (none on ranks other than 0)."""

    def __init__(self, writers: Sequence[EventWriter] = ()):
        self.writers = list(writers)

    @classmethod
    def build(cls, section: MonitoringConfig, *, global_rank: int) -> "EventWriters":
        # Every rank checks the packages, so a missing one stops all ranks at the same point (rank 0 alone
        # stopping would leave the others waiting in their next collective).
        for on, module, key in ((section.tensorboard.enabled, "tensorboard", "tensorboard.enabled"),
                                (section.wandb.enabled, "wandb", "wandb.enabled")):
            if on:
                require_package(module, key, load=False)
        if global_rank != 0:
            return cls()
        writers: list[EventWriter] = []
        if section.tensorboard.enabled:
            writers.append(TensorBoardWriter(section.tensorboard))
        if section.csv_monitor.enabled:
            writers.append(CSVWriter(section.csv_monitor))
        if section.wandb.enabled:
            writers.append(WandbWriter(section.wandb))
        return cls(writers)

    @property
    def enabled(self) -> bool:
        return bool(self.writers)

    def write(self, events: Sequence[Event]) -> None:
        # A non-finite value (a skipped fp16 step's loss) is still written: it is what happened.
        rows = [(tag, float(value), int(x)) for tag, value, x in events if value is not None]
        if rows:
            for writer in self.writers:
                writer.write(rows)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []
