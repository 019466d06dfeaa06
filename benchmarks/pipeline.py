"""Pipeline step time: shardwise's `PipelineRuntime` against `torch.distributed.pipelining`, on the very same
stage modules, with the same micro-batching; and the bubble each leaves, against the formula.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.pipeline \\
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
import os
import sys
import time
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import args_meta, int_at_least, run_in_gloo_group, run_under_launcher, write_json
from benchmarks.pipeline_models import MODELS, build_model
from benchmarks.pipeline_report import Bubble, Row, analyse, make_row, print_table
from shardwise.config import PipelinePartition, PipelineSchedule

__all__ = ["Bubble", "Bench", "Impl", "Row", "analyse", "launch", "main", "make_row", "measure", "run",
           "torch_supports"]


class Impl(str, Enum):
    SHARDWISE, TORCH = "shardwise", "torch"


def torch_supports(kind: PipelineSchedule, num_stages: int, num_microbatches: int) -> str:
    """Empty when torch's schedule runs at (P, M), else why not. ScheduleInterleaved1F1B splits the M
    micro-batches into max(1, M // P) rounds and requires them to divide M."""
    if kind is PipelineSchedule.INTERLEAVED_1F1B:
        rounds = max(1, num_microbatches // num_stages)
        if num_microbatches % rounds:
            return f"torch needs M % max(1, M // P) == 0; M = {num_microbatches}, P = {num_stages}"
    return ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch.distributed.run --nproc-per-node P -m benchmarks.pipeline",
        description="Pipeline step time of shardwise's PipelineRuntime against torch.distributed.pipelining, and "
                    "the bubble each leaves against the formula.")
    p.add_argument("--schedules", nargs="+", choices=[k.value for k in PipelineSchedule],
                   default=[k.value for k in PipelineSchedule], help="(default: all)")
    p.add_argument("--virtual-stages", type=int_at_least(2), default=2, help="V for interleaved 1F1B "
                   "(default: %(default)s)")
    p.add_argument("--microbatches", type=int_at_least(1), default=16, help="M (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int_at_least(1), default=1, help="sequences per micro-batch "
                   "(default: %(default)s)")
    p.add_argument("--model", choices=MODELS, default="gpt", help="gpt: the built-in GPT; mlp: --layers identical "
                   "residual MLP blocks and an MSE loss, stages equal by construction as the bubble formula assumes "
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
        from shardwise.parallel.pipeline.runtime import PipelineRuntime
        from shardwise.parallel.pipeline.stage import split_model

        self.rank, self.p = dist.get_rank(), dist.get_world_size()
        self.kind, self.m = kind, args.microbatches
        self.v = args.virtual_stages if kind is PipelineSchedule.INTERLEAVED_1F1B else 1
        model, self.inputs, self.labels = build_model(args, self.m)   # the same full model on every rank
        self.stage = split_model(model, num_stages=self.p, stage=self.rank, virtual_stages=self.v,
                                 partition=args.partition)
        self.params = list(self.stage.parameters())
        self.runtime = PipelineRuntime(self.stage, Comm(sw_group, CommLedger(), name="pp"), schedule=kind,
                                       num_microbatches=self.m)
        self.micro = list(zip(self.inputs.chunk(self.m), self.labels.chunk(self.m)))
        self.torch_note = torch_supports(kind, self.p, self.m)
        self.schedule = None
        self.last_losses: list[float] = []
        self.last_records: list[tuple[int, str, float, float]] = []
        if not self.torch_note:
            stages = [PipelineStage(chunk, stage_index=self.stage.model_chunk(v), num_stages=self.p * self.v,
                                    device=torch.device("cpu"), group=torch_group)
                      for v, chunk in enumerate(self.stage.chunks)]
            loss_fn = self.stage.loss_fn        # mean loss of one micro-batch (cross-entropy or MSE)
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
    from shardwise.parallel.pipeline.schedules import bubble_fraction
    from shardwise.parallel.pipeline.simulate import Timeline
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
    formula = float(bubble_fraction(kind, num_stages=bench.p, num_microbatches=bench.m, virtual_stages=bench.v))
    return make_row(kind, bench.v, times[:, 0].tolist(), times[:, 1].tolist() if has_torch else None, bubbles,
                    formula, torch_bubbles or None, loss_diff, grad_diff, bench.torch_note)


def run(args: argparse.Namespace) -> list[Row]:
    """Measure every schedule on the already initialized default group; rank 0 prints and writes JSON."""
    world = dist.get_world_size()
    # Separate groups, so neither implementation's p2p messages can meet the other's.
    sw_group, torch_group = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    rows = [measure(args, PipelineSchedule(k), sw_group, torch_group) for k in args.schedules]
    if dist.get_rank() == 0:
        print_table(rows, world_size=world, args=args)
        if args.json is not None:
            meta = args_meta(args)
            meta["world_size"] = world
            write_json(args.json, {"config": meta, "rows": [asdict(r) for r in rows]})
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
    if args.model == "gpt" and args.d_model % args.heads:
        raise ValueError(f"--d-model = {args.d_model} must be a multiple of --heads = {args.heads}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank under torch.distributed.run (it sets RANK, WORLD_SIZE, MASTER_ADDR)."""
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: python -m torch.distributed.run "
              "--nproc-per-node 2 -m benchmarks.pipeline (or `shardwise bench pipeline --nproc 2`)",
              file=sys.stderr)
        return 2
    check_args(args, int(os.environ["WORLD_SIZE"]))
    return run_in_gloo_group(run, args)     # one thread per rank, barrier before teardown


def launch(nproc: int, argv: Sequence[str] = ()) -> int:
    """Run this benchmark on `nproc` local ranks via torch's elastic launcher; returns its exit code.
    `argv` are this module's own options (e.g. ["--microbatches", "8", "--json", "out.json"])."""
    check_args(build_parser().parse_args(list(argv)), nproc)   # reject bad options here, not on every rank
    return run_under_launcher("benchmarks.pipeline", nproc, argv)


if __name__ == "__main__":
    from shardwise.engine.initialize import exit_rank
    exit_rank(main())
