"""The pipeline benchmark's results: one `Row` per schedule, the per-step `Bubble` analysis, and the tables.
See `benchmarks.pipeline` for what is measured and how."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from shardwise.config import PipelineSchedule


@dataclass(frozen=True)
class Row:
    """One schedule. Times in ms: the median over rounds of the slowest rank's step time. Bubbles: medians over
    the rounds of the fraction of P * makespan that is not compute."""

    schedule: str
    virtual_stages: int
    shardwise_ms: float
    torch_ms: float | None            # None: torch does not support this schedule at this (P, M)
    ratio: float | None               # shardwise / torch median step time (< 1: shardwise is faster)
    paired_ratio: float | None        # median over rounds of shardwise time / torch time in that round
    bubble_measured: float            # shardwise's Timeline.bubble_fraction
    bubble_simulated: float           # the schedule simulated with shardwise's measured per-(stage, chunk) costs
    bubble_replayed: float            # the schedule simulated with each action's own measured time
    bubble_formula: float             # schedules.bubble_fraction(schedule, P, M, V): equal stages
    torch_bubble_measured: float | None
    stage_ms: list[float]             # shardwise: mean forward + backward of one micro-batch on each stage
    loss_diff: float | None           # |shardwise loss - torch loss| of the warm-up step
    grad_diff: float | None           # max |shardwise grad - torch grad| over all parameters, warm-up step
    note: str = ""


def make_row(kind: PipelineSchedule, v: int, sw_s: Sequence[float], torch_s: Sequence[float] | None,
             bubbles: Sequence[Bubble], formula: float, torch_bubbles: Sequence[float] | None,
             loss_diff: float | None, grad_diff: float | None, note: str = "") -> Row:
    """Medians and ratios from per-round times in seconds (index i of both lists: the same round)."""
    sw = statistics.median(sw_s)
    th = statistics.median(torch_s) if torch_s else None
    stages = len(bubbles[0].stage_s)
    return Row(schedule=kind.value, virtual_stages=v, shardwise_ms=sw * 1e3,
               torch_ms=None if th is None else th * 1e3, ratio=None if th is None else sw / th,
               paired_ratio=None if not torch_s else statistics.median(s / t for s, t in zip(sw_s, torch_s)),
               bubble_measured=statistics.median(b.measured for b in bubbles),
               bubble_simulated=statistics.median(b.simulated for b in bubbles),
               bubble_replayed=statistics.median(b.replayed for b in bubbles), bubble_formula=formula,
               torch_bubble_measured=statistics.median(torch_bubbles) if torch_bubbles else None,
               stage_ms=[statistics.median(b.stage_s[s] for b in bubbles) * 1e3 for s in range(stages)],
               loss_diff=loss_diff, grad_diff=grad_diff, note=note)


@dataclass(frozen=True)
class Bubble:
    """One step's measured bubble, its simulation under the step's own measured costs, and the costs."""

    measured: float
    simulated: float                  # under the mean measured cost of each (stage, chunk, forward/backward)
    replayed: float                   # under each action's own measured time
    stage_s: list[float]              # mean forward + backward seconds of one micro-batch on each stage


def analyse(records: Sequence[Any], kind: PipelineSchedule, num_stages: int, num_microbatches: int,
            virtual_stages: int) -> Bubble:
    """``records``: (stage, action, start, end) of every rank's computes in one step."""
    from shardwise.parallel.pipeline.schedules import build_schedule
    from shardwise.parallel.pipeline.simulate import Timeline, measured_costs, replayed_costs, simulate
    timeline = Timeline.from_records(records, num_stages=num_stages)
    schedule = build_schedule(kind, num_stages=num_stages, num_microbatches=num_microbatches,
                              virtual_stages=virtual_stages)
    costs = measured_costs(timeline)
    simulated = simulate(schedule, costs=costs).bubble_fraction
    replayed = simulate(schedule, costs=replayed_costs(timeline)).bubble_fraction
    stage_s = [float(sum(f) + sum(b)) for f, b in zip(costs.forward, costs.backward)]   # type: ignore[arg-type]
    return Bubble(float(timeline.bubble_fraction), float(simulated), float(replayed), stage_s)


def print_table(rows: Sequence[Row], *, world_size: int, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    def opt(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    where = (f"P = {world_size} stages (gloo, CPU, 1 thread/rank), {args.model.upper()} d={args.d_model} "
             f"L={args.layers} seq={args.seq} ({args.partition}), M = {args.microbatches} x {args.micro_batch_size} "
             f"seqs: median of {args.rounds} alternating rounds")
    steps = Table(title=f"pipeline step, {where}")
    for name in ("schedule", "V", "shardwise ms", "torch ms", "shardwise/torch", "paired", "|loss diff|",
                 "max |grad diff|", "note"):
        steps.add_column(name, justify="left" if name in ("schedule", "note") else "right")
    bubble = Table(title=f"bubble (idle share of P x makespan), {where}")
    for name in ("schedule", "V", "stage ms (F+B per micro-batch)", "formula", "simulated, mean costs",
                 "replayed", "shardwise measured", "measured / simulated", "torch measured"):
        bubble.add_column(name, justify="left" if name == "schedule" else "right")
    for r in rows:
        steps.add_row(r.schedule, str(r.virtual_stages), f"{r.shardwise_ms:.1f}", opt(r.torch_ms, ".1f"),
                      opt(r.ratio, ".3f"), opt(r.paired_ratio, ".3f"), opt(r.loss_diff, ".1e"),
                      opt(r.grad_diff, ".1e"), r.note)
        bubble.add_row(r.schedule, str(r.virtual_stages), " ".join(f"{x:.1f}" for x in r.stage_ms),
                       f"{r.bubble_formula:.3f}", f"{r.bubble_simulated:.3f}", f"{r.bubble_replayed:.3f}",
                       f"{r.bubble_measured:.3f}",
                       f"{r.bubble_measured / r.bubble_simulated:.2f}" if r.bubble_simulated else "-",
                       opt(r.torch_bubble_measured, ".3f"))
    console = Console()
    if not console.is_terminal:     # piped into a file or a log: do not squeeze the tables
        console = Console(width=180)
    console.print(steps)
    console.print(bubble)
