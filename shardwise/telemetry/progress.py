"""What a person watching a run sees: a live progress bar during training and a summary table after.

Only global rank 0 shows anything (`enabled=False` elsewhere), so N ranks never print N bars. When
stdout is not a terminal (CI logs, `| tee`, a file) a redrawn bar would be a wall of control codes,
so the bar degrades to one plain line every `steps_per_print` steps (and on the first and last step), whose
throughput, MFU and step time are those of the steps since the previous line: one line per interval, with the
interval's figures (the summary's mean tokens/s is the same sum over more steps).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Table

from shardwise.telemetry.metrics import RunSummary, StepMetrics, format_bytes, format_rate

# Memory columns of `engine.memory_report()`, in display order, with their headers.
_MEMORY_COLUMNS = (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
                   ("activations", "activations"), ("peak_rss", "peak RSS"))


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    return str(_dt.timedelta(seconds=round(seconds)))


def format_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


def format_update(m: StepMetrics) -> str:
    """Gradient norm, loss scale and skips of one step: 'gnorm 1.83 | scale 65536 | skipped 2 (this step)'."""
    gnorm = "-" if m.grad_norm is None else f"{m.grad_norm:.3g}"
    skips = f"skipped {m.skipped_steps}" + (" (this step)" if m.skipped else "")
    return f"gnorm {gnorm} | scale {m.loss_scale:g} | {skips}" + format_moe(m)


def format_moe(m: StepMetrics) -> str:
    """An MoE model's step: ' | moe drop 1.2% load 1.35 aux 1.02 z 0.41' (drop: choices over capacity; load: the
    busiest expert's tokens over the mean, the worst layer's); '' for a model without MoE layers."""
    if m.moe_tokens_per_expert is None or m.moe_dropped_tokens is None:
        return ""
    ran = sum(map(sum, m.moe_tokens_per_expert))
    routed = ran + m.moe_dropped_tokens
    drop = 100 * m.moe_dropped_tokens / routed if routed else 0.0
    load = max((max(row) * len(row) / sum(row) for row in m.moe_tokens_per_expert if sum(row)), default=0.0)
    aux = "-" if m.moe_aux_loss is None else f"{m.moe_aux_loss:.3g}"
    z = "-" if m.moe_z_loss is None else f"{m.moe_z_loss:.3g}"
    return f" | moe drop {drop:.1f}% load {load:.2f} aux {aux} z {z}"


class TrainProgress:
    """Progress of `total_steps` optimizer steps: step/total, loss, gradient norm, loss scale, skipped steps,
    tokens/s, MFU and ETA.

    Use as a context manager and call `update(metrics)` once per step:

        with TrainProgress(steps, enabled=rank == 0, steps_per_print=10) as progress:
            for step in ...:
                progress.update(StepMetrics.build(...))

    The ETA is remaining steps times the mean step time so far, leaving out the first step (warm-up)
    once there is a second one.
    """

    def __init__(self, total_steps: int, enabled: bool, *, steps_per_print: int = 10,
                 console: Console | None = None, done: int = 0):
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.total_steps = total_steps
        self.done = done
        """Steps finished before this process started (a resumed run)."""
        self.enabled = enabled
        self.steps_per_print = max(1, steps_per_print)
        self.console = console if console is not None else Console()
        self.live = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._times: list[float] = []
        self._window: list[StepMetrics] = []
        """The steps since the last printed line (plain-line mode)."""

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> "TrainProgress":
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss [cyan]{task.fields[loss]}"),
                TextColumn("{task.fields[update]}"),
                TextColumn("{task.fields[rate]} tok/s"),
                TextColumn("MFU {task.fields[mfu]}"),
                TextColumn("ETA {task.fields[eta]}"),
                console=self.console, transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total_steps, completed=self.done, loss="-",
                                                 rate="-", mfu="-", eta=format_eta(None), update="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # -- per step ---------------------------------------------------------------------------------
    def eta_s(self) -> float | None:
        """Seconds left at the mean pace of the steps seen so far (None before the first step)."""
        if not self._times:
            return None
        steady = self._times[1:] or self._times
        return (self.total_steps - self.done - len(self._times)) * sum(steady) / len(steady)

    def update(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        self._times.append(m.step_time_s)
        eta = format_eta(self.eta_s())
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=m.step, loss=f"{m.loss:.4f}",
                                  rate=format_rate(m.tokens_per_s), mfu=format_mfu(m.mfu), eta=eta,
                                  update=format_update(m))
            return
        self._window.append(m)
        if self._should_print(m.step) or m.skipped:     # a skipped update is never silent
            window, self._window = self._window, []
            seconds = sum(w.step_time_s for w in window)
            rate = sum(w.tokens for w in window) / seconds if seconds > 0 else 0.0
            # Time-weighted like the rate: the MFU of the interval's tokens over its time.
            mfu = None if any(w.mfu is None for w in window) or seconds <= 0 else \
                sum(float(w.mfu or 0.0) * w.step_time_s for w in window) / seconds
            steps = f"step {m.step}" if len(window) == 1 else f"steps {window[0].step}-{m.step}"
            self.console.print(
                f"step {m.step}/{self.total_steps} | loss {m.loss:.4f} | lr {m.lr:.3e} | {format_update(m)} | "
                f"{format_rate(rate)} tok/s | MFU {format_mfu(mfu)} | "
                f"{seconds / len(window):.3f} s/step ({steps}) | ETA {eta}",
                markup=False, highlight=False, soft_wrap=True,
            )

    def _should_print(self, step: int) -> bool:
        return step == self.done + 1 or step == self.total_steps or step % self.steps_per_print == 0


def summary_tables(summary: RunSummary) -> list[Table]:
    """The summary as rich tables: headline figures, memory per rank, communication per step."""
    head = Table(title="Training summary", show_header=False, title_justify="left")
    head.add_column("figure", style="bold")
    head.add_column("value", justify="right")
    rows: list[tuple[str, Any]] = [
        ("steps", summary.steps),
        ("final loss", f"{summary.final_loss:.4f}"),
        ("final gradient norm", "-" if summary.final_grad_norm is None else f"{summary.final_grad_norm:.4g}"),
        ("final loss scale", f"{summary.final_loss_scale:g}"),
        ("skipped steps", summary.skipped_steps),
        ("tokens / step", f"{summary.tokens_per_step:,}"),
        ("mean tokens/s (steps 2..N)", format_rate(summary.mean_tokens_per_s)),
        ("MFU", format_mfu(summary.mfu)),
        ("model FLOPs / token", format_rate(summary.flops_per_token)),
        (f"peak FLOP/s ({summary.world_size} ranks)", format_rate(summary.peak_flops)),
        ("communication / step (rank 0)", format_bytes(summary.comm_bytes_per_step)),
        ("wall time", format_eta(summary.total_time_s)),
    ]
    if summary.final_eval_loss is not None:
        over = "" if summary.final_eval_windows is None else f", {summary.final_eval_windows} windows"
        rows[2:2] = [(f"final eval loss (held out{over})", f"{summary.final_eval_loss:.4f}"),
                     ("final eval perplexity", f"{summary.final_eval_perplexity:.3f}")]
    for name, value in rows:
        head.add_row(name, str(value))
    tables = [head]

    if summary.memory_per_rank:
        mem = Table(title="Memory per rank", title_justify="left")
        mem.add_column("rank", justify="right")
        present = [(k, h) for k, h in _MEMORY_COLUMNS if any(k in m for m in summary.memory_per_rank)]
        for _, header in present:
            mem.add_column(header, justify="right")
        for rank, m in enumerate(summary.memory_per_rank):
            mem.add_row(str(rank), *(format_bytes(m[k]) if k in m else "-" for k, _ in present))
        tables.append(mem)

    if summary.comm_per_step:
        comm = Table(title="Communication per step (rank 0)", title_justify="left")
        for header in ("op", "group", "size", "dtype", "count", "bytes"):
            comm.add_column(header, justify="left" if header in ("op", "group", "dtype") else "right")
        for row in summary.comm_per_step:
            comm.add_row(str(row.get("op", "?")), str(row.get("group", "?")), str(row.get("group_size", "")),
                         str(row.get("dtype", "")), str(row.get("count", "")),
                         format_bytes(int(row.get("bytes", 0))))
        tables.append(comm)
    return tables


def print_summary(summary: RunSummary, *, console: Console | None = None) -> None:
    """Print the summary tables (rank 0 only: the caller gathers per-rank memory first)."""
    console = console if console is not None else Console()
    for table in summary_tables(summary):
        console.print(table)
