"""Pipeline step time: shardwise's `PipelineRuntime` against `torch.distributed.pipelining`, on the very same
stage modules, with the same micro-batching; and the bubble each leaves, against the formula.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m shardwise.benchmarks.pipeline \\
        --d-model 256 --layers 8 --seq 128 --microbatches 16 --rounds 10 --json pipeline.json

P = the number of ranks = pipeline stages. For each schedule (GPipe, 1F1B, interleaved 1F1B with V virtual
stages) every rank builds the same GPT from one seed and cuts it with `split_model`; shardwise runs the stage
with `PipelineRuntime`, torch wraps the same `StageChunk` modules in `PipelineStage`s (stage index v * P + rank,
torch's looped placement = shardwise's chunk order) and runs `ScheduleGPipe`, `Schedule1F1B` or
`ScheduleInterleaved1F1B`. The two alternate round by round, each step after a barrier with zeroed gradients; a
step's time is the slowest rank's. Reported: median step times, their ratio shardwise / torch (< 1: shardwise is
faster) and the median of the per-round ratios ("paired", robust to load drift on a shared machine).

Correctness first: in the warm-up both implementations run one step on the same batch and their losses and
parameter gradients are compared (no optimizer step is taken, so the weights never change).

Bubble. Every rank records each forward (loss included) and backward it computes, for both implementations
(torch's through ``forward_one_chunk`` / ``backward_one_chunk`` and its loss); a step's records make a
`Timeline`, whose ``bubble_fraction`` = sum idle / (P * makespan) counts all that is not compute as idle: p2p
waits and the runtime's own work. The formula, (P-1)/(M+P-1) for GPipe and 1F1B, (P-1)/(V*M+P-1) interleaved,
assumes equal stages and free communication; here the last stage also carries the lm-head and the loss. So each
shardwise step is also simulated with its measured mean forward and backward time of every (stage, chunk)
(`measured_costs`), no latency: the formula's schedule with these stages, the fair yardstick. And replayed with
each action's own measured time (`replayed_costs`): from the replay to the measurement is p2p latency and the
runtime's work; from the mean-cost simulation to the replay, the spread of compute times (a shared machine's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from shardwise.benchmarks.common import int_at_least, run_in_gloo_group, run_under_launcher
from shardwise.config.resolved import PipelinePartition, PipelineSchedule


class Impl(str, Enum):
    SHARDWISE, TORCH = "shardwise", "torch"


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
    bubble_formula: float             # formula_bubble_fraction(schedule, P, M, V): equal stages
    torch_bubble_measured: float | None
    stage_ms: list[float]             # shardwise: mean forward + backward of one micro-batch on each stage
    loss_diff: float | None           # |shardwise loss - torch loss| of the warm-up step
    grad_diff: float | None           # max |shardwise grad - torch grad| over all parameters, warm-up step
    note: str = ""


def torch_supports(kind: PipelineSchedule, num_stages: int, num_microbatches: int) -> str:
    """Empty when torch's schedule runs at (P, M), else why not. ScheduleInterleaved1F1B splits the M
    micro-batches into max(1, M // P) rounds and requires them to divide M."""
    if kind is PipelineSchedule.INTERLEAVED_1F1B:
        rounds = max(1, num_microbatches // num_stages)
        if num_microbatches % rounds:
            return f"torch needs M % max(1, M // P) == 0; M = {num_microbatches}, P = {num_stages}"
    return ""


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch.distributed.run --nproc-per-node P -m shardwise.benchmarks.pipeline",
        description="Pipeline step time of shardwise's PipelineRuntime against torch.distributed.pipelining, and "
                    "the bubble each leaves against the formula.")
    p.add_argument("--schedules", nargs="+", choices=[k.value for k in PipelineSchedule],
                   default=[k.value for k in PipelineSchedule], help="(default: all)")
    p.add_argument("--virtual-stages", type=int_at_least(2), default=2, help="V for interleaved 1F1B "
                   "(default: %(default)s)")
    p.add_argument("--microbatches", type=int_at_least(1), default=16, help="M (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int_at_least(1), default=1, help="sequences per micro-batch "
                   "(default: %(default)s)")
    p.add_argument("--d-model", type=int_at_least(8), default=256, help="(default: %(default)s)")
    p.add_argument("--heads", type=int_at_least(1), default=4, help="(default: %(default)s)")
    p.add_argument("--layers", type=int_at_least(1), default=8, help="transformer blocks (default: %(default)s)")
    p.add_argument("--seq", type=int_at_least(1), default=128, help="sequence length (default: %(default)s)")
    p.add_argument("--partition", choices=[k.value for k in PipelinePartition], default="uniform",
                   help="how the blocks are cut into stages (default: %(default)s; 'flops' counts the embedding "
                        "and the lm-head with the first and last block)")
    p.add_argument("--rounds", type=int_at_least(1), default=10, help="timed steps per implementation and "
                   "schedule (default: %(default)s)")
    p.add_argument("--warmup", type=int_at_least(1), default=2, help="untimed steps each first, the first one "
                   "compared (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the rows to OUT")
    return p


class Bench:
    """This rank's stage of one schedule, run by both implementations; `step(impl)` times one step."""

    def __init__(self, args: argparse.Namespace, kind: PipelineSchedule, sw_group: Any, torch_group: Any) -> None:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        from shardwise.comm.collectives import Comm
        from shardwise.comm.ledger import CommLedger
        from shardwise.models import GPT, gpt_config
        from shardwise.parallel.pipeline.runtime import PipelineRuntime
        from shardwise.parallel.pipeline.stage import split_model

        self.rank, self.p = dist.get_rank(), dist.get_world_size()
        self.kind, self.m = kind, args.microbatches
        self.v = args.virtual_stages if kind is PipelineSchedule.INTERLEAVED_1F1B else 1
        torch.manual_seed(1234)             # the same full model on every rank; each keeps its own chunks
        cfg = gpt_config("tiny", n_layer=args.layers, d_model=args.d_model, n_head=args.heads, seq_len=args.seq,
                         dropout=0.0, tie_embeddings=False)
        self.stage = split_model(GPT(cfg), num_stages=self.p, stage=self.rank, virtual_stages=self.v,
                                 partition=args.partition)
        self.params = list(self.stage.parameters())
        self.runtime = PipelineRuntime(self.stage, Comm(sw_group, CommLedger(), name="pp"), schedule=kind,
                                       num_microbatches=self.m)
        g = torch.Generator().manual_seed(7)
        # rows: [M * micro_batch_size, seq + 1] tokens; inputs are the first seq, labels the last seq
        rows = torch.randint(0, cfg.vocab_size, (self.m * args.micro_batch_size, args.seq + 1), generator=g)
        self.inputs, self.labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        self.micro = list(zip(self.inputs.chunk(self.m), self.labels.chunk(self.m)))
        self.torch_note = torch_supports(kind, self.p, self.m)
        self.schedule = None
        self.last_losses: list[float] = []
        self.last_records: list[tuple[int, str, float, float]] = []
        if not self.torch_note:
            stages = [PipelineStage(chunk, stage_index=self.stage.model_chunk(v), num_stages=self.p * self.v,
                                    device=torch.device("cpu"), group=torch_group)
                      for v, chunk in enumerate(self.stage.chunks)]
            loss_fn = self.stage.loss_fn        # GPT.loss: mean cross-entropy of one micro-batch
            if kind is PipelineSchedule.GPIPE:
                self.schedule = ScheduleGPipe(stages[0], self.m, loss_fn=loss_fn)
            elif kind is PipelineSchedule.ONE_F_ONE_B:
                self.schedule = Schedule1F1B(stages[0], self.m, loss_fn=loss_fn)
            else:
                self.schedule = ScheduleInterleaved1F1B(stages, self.m, loss_fn=loss_fn)
            self._record_torch(stages)

    def _record_torch(self, stages: list[Any]) -> None:
        """Time torch's computes like shardwise's: each stage's forward (with the loss after it, on the last
        one) and backward of one micro-batch, as (stage, action text, start, end)."""
        def timed(fn: Any, op: str, chunk: int) -> Any:
            def run(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                out = fn(chunk_id, *args, **kwargs)
                self.last_records.append((self.rank, f"{op}{chunk_id}.{chunk}", start, time.perf_counter()))
                return out
            return run

        for v, st in enumerate(stages):
            st.forward_one_chunk = timed(st.forward_one_chunk, "F", v)
            st.backward_one_chunk = timed(st.backward_one_chunk, "B", v)
        compute_loss = self.schedule._maybe_compute_loss    # runs right after the last stage's forward
        def with_loss(*args: Any, **kwargs: Any) -> Any:
            out = compute_loss(*args, **kwargs)
            if self.last_records and self.holds_last:
                rank, action, start, _ = self.last_records[-1]
                self.last_records[-1] = (rank, action, start, time.perf_counter())
            return out

        self.schedule._maybe_compute_loss = with_loss

    @property
    def holds_last(self) -> bool:
        return self.rank == self.p - 1       # model chunk P*V - 1 lives on stage P - 1 in both layouts

    def step(self, impl: Impl) -> float:
        """One step (gradients zeroed before); this rank's seconds."""
        for p in self.params:
            p.grad = None
        self.last_records = []
        dist.barrier()                       # align the start: a step lasts from the first rank's start
        t0 = time.perf_counter()
        if impl is Impl.SHARDWISE:
            result = self.runtime.step(self.micro)
            self.last_losses = result.losses
            self.last_records = [(r.stage, str(r.action), r.start, r.end) for r in result.records]
        else:
            assert self.schedule is not None
            losses: list[torch.Tensor] = []
            args = (self.inputs,) if self.rank == 0 else ()
            target = self.labels if self.holds_last else None
            self.schedule.step(*args, target=target, losses=losses if self.holds_last else None,
                               return_outputs=False)
            self.last_losses = [float(x.detach()) for x in losses]
        return time.perf_counter() - t0

    def grads(self) -> list[torch.Tensor]:
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.params]

    def close(self) -> None:
        self.runtime.close()


def _compare(bench: Bench) -> tuple[float, float]:
    """One step of each on the same batch: |loss difference| and max |grad difference|, over all ranks."""
    bench.step(Impl.SHARDWISE)
    sw_loss, sw_grads = bench.last_losses, bench.grads()
    bench.step(Impl.TORCH)
    th_loss, th_grads = bench.last_losses, bench.grads()
    diffs = torch.zeros(2, dtype=torch.float64)
    if bench.holds_last:
        diffs[0] = abs(sum(sw_loss) / len(sw_loss) - sum(th_loss) / len(th_loss))
    diffs[1] = max(float((a - b).abs().max()) for a, b in zip(sw_grads, th_grads))
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    return float(diffs[0]), float(diffs[1])


def _gathered_records(bench: Bench) -> list[Any]:
    gathered: list[Any] = [None] * bench.p
    dist.all_gather_object(gathered, bench.last_records)
    return [r for rs in gathered for r in rs]


def measure(args: argparse.Namespace, kind: PipelineSchedule, sw_group: Any, torch_group: Any) -> Row:
    from shardwise.parallel.pipeline.simulate import Timeline, formula_bubble_fraction
    bench = Bench(args, kind, sw_group, torch_group)
    has_torch = bench.schedule is not None
    loss_diff = grad_diff = None
    if has_torch:
        loss_diff, grad_diff = _compare(bench)
    order = [Impl.SHARDWISE, Impl.TORCH] if has_torch else [Impl.SHARDWISE]
    for _ in range(args.warmup):
        for impl in order:
            bench.step(impl)
    # times: [rounds, 2] seconds on this rank, column = position in `order`
    times = torch.zeros(args.rounds, 2, dtype=torch.float64)
    bubbles, torch_bubbles = [], []
    for i in range(args.rounds):
        for impl in (order if i % 2 == 0 else order[::-1]):
            times[i, order.index(impl)] = bench.step(impl)
            records = _gathered_records(bench)
            if impl is Impl.SHARDWISE:
                bubbles.append(analyse(records, kind, bench.p, bench.m, bench.v))
            else:
                torch_bubbles.append(float(Timeline.from_records(records, num_stages=bench.p).bubble_fraction))
    dist.all_reduce(times, op=dist.ReduceOp.MAX)     # a step lasts as long as its slowest stage
    bench.close()
    formula = float(formula_bubble_fraction(kind, num_stages=bench.p, num_microbatches=bench.m,
                                            virtual_stages=bench.v))
    return make_row(kind, bench.v, times[:, 0].tolist(), times[:, 1].tolist() if has_torch else None, bubbles,
                    formula, torch_bubbles or None, loss_diff, grad_diff, bench.torch_note)


def print_table(rows: Sequence[Row], *, world_size: int, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    def opt(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    where = (f"P = {world_size} stages (gloo, CPU, 1 thread/rank), GPT d={args.d_model} L={args.layers} "
             f"seq={args.seq} ({args.partition}), M = {args.microbatches} x {args.micro_batch_size} seqs: median of "
             f"{args.rounds} alternating rounds")
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


def run(args: argparse.Namespace) -> list[Row]:
    """Measure every schedule on the already initialized default group; rank 0 prints and writes JSON."""
    world = dist.get_world_size()
    # Separate groups, so neither implementation's p2p messages can meet the other's.
    sw_group, torch_group = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    rows = [measure(args, PipelineSchedule(k), sw_group, torch_group) for k in args.schedules]
    if dist.get_rank() == 0:
        print_table(rows, world_size=world, args=args)
        if args.json is not None:
            meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
            meta["world_size"] = world
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"config": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    return rows


def check_args(args: argparse.Namespace, nproc: int) -> None:
    """Reject shapes split_model cannot cut: every model chunk needs at least one block."""
    if nproc < 2:
        raise ValueError(f"pipeline benchmark: --nproc must be >= 2 (one rank is no pipeline); got {nproc}. "
                         f"Use --nproc 2 or more.")
    v = args.virtual_stages if PipelineSchedule.INTERLEAVED_1F1B.value in args.schedules else 1
    if args.layers < nproc * v:
        raise ValueError(f"--layers = {args.layers} is fewer than P * V = {nproc} * {v} model chunks; every chunk "
                         f"needs a block: e.g. --layers {nproc * v * 2}")
    if args.partition == PipelinePartition.UNIFORM.value and args.layers % (nproc * v):
        raise ValueError(f"--layers = {args.layers} must be a multiple of P * V = {nproc} * {v} (uniform "
                         f"partition, one equal chunk per virtual stage); e.g. --layers {nproc * v * 2}")
    if args.d_model % args.heads:
        raise ValueError(f"--d-model = {args.d_model} must be a multiple of --heads = {args.heads}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank under torch.distributed.run (it sets RANK, WORLD_SIZE, MASTER_ADDR)."""
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: python -m torch.distributed.run "
              "--nproc-per-node 2 -m shardwise.benchmarks.pipeline (or `shardwise bench pipeline --nproc 2`)",
              file=sys.stderr)
        return 2
    check_args(args, int(os.environ["WORLD_SIZE"]))
    return run_in_gloo_group(run, args)     # one thread per rank, barrier before teardown


def launch(nproc: int, argv: Sequence[str] = ()) -> int:
    """Run this benchmark on `nproc` local ranks via torch's elastic launcher; returns its exit code.
    `argv` are this module's own options (e.g. ["--microbatches", "8", "--json", "out.json"])."""
    check_args(build_parser().parse_args(list(argv)), nproc)   # reject bad options here, not on every rank
    return run_under_launcher("shardwise.benchmarks.pipeline", nproc, argv)


if __name__ == "__main__":
    from shardwise.build import exit_rank
    exit_rank(main())
