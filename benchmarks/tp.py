"""Tensor-parallel step time: shardwise's TP engine against torch DTensor `parallelize_module`, on one GPT.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.tp \\
        --d-model 256 --layers 4 --seq 128 --micro-batch 4 --rounds 10 --steps 3 --json tp.json

T = the number of ranks = the TP size (dp = 1): every rank builds the same full GPT from one seed, and both
trainers (`tp_trainers.py`) split a copy of it over all ranks and train it with torch's AdamW in fp32 on the
same micro-batch: shardwise through `shardwise.initialize` (ZeRO stage 0, `tensor_parallel.size` = T), torch
through `parallelize_module` with Colwise/Rowwise plans and `loss_parallel`. `--sequence-parallel` turns on
sequence parallelism in both (shardwise's `tensor_parallel.sequence_parallel`, torch's SequenceParallel).

Correctness first: the `--warmup` steps run both trainers step by step on the same batches, and the run stops
unless every warm-up loss and the first step's gradients (every local shard, before the optimizer step)
agree within `--rtol`: the same forward, backward and AdamW update. Then `--rounds` rounds each run `--steps`
steps of either trainer, alternating which goes first; every step starts after a barrier and lasts as long
as its slowest rank. The report gives per trainer the median step time, the spread of the per-round medians,
tokens/s, the ratio shardwise/this of the medians (< 1: shardwise is faster) and the paired ratio (median over
rounds of the ratio within a round, which cancels load that drifts between rounds on a shared machine).

Memory: the two trainers share a process per rank, so peak RSS cannot be split between them; it is reported
once per rank. Per trainer the table gives, measured from its own tensors on one rank: the model states
(parameters, gradient buffers, AdamW moments; distinct storages) and the activations one forward saves for
backward (distinct storages, parameters and the batch excluded, DTensors by their local tensor; the same
meter for both), which together are what a step holds at its peak apart from transient buffers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import (
    TimedRow, add_side_by_side_args, args_meta, compare_times, int_at_least, positive_float, rotation, rss_per_rank, run_in_gloo_group,
    run_under_launcher, write_json,
)
from benchmarks.trainers import MIB


class Impl(str, Enum):
    SHARDWISE = "shardwise"
    TORCH = "torch"


@dataclass(frozen=True)
class Row(TimedRow):
    """One trainer's figures: the timing columns (tokens_per_s counts the TP group's micro-batch) and memory in
    bytes on one rank."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int         # saved for backward by one forward

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


# -- pure arithmetic ----------------------------------------------------------------------------------

def summarize(times_s: dict[str, list[list[float]]], memory: dict[str, dict[str, int]], *,
              tokens_per_step: int) -> list[Row]:
    """Rows from step times `times_s[trainer][round][step]` (seconds) and `memory[trainer]` (bytes: params,
    grads, optimizer, activations). Needs a "shardwise" entry, the numerator of every ratio."""
    rows = []
    for name, t in compare_times(times_s, Impl.SHARDWISE.value).items():
        mem = memory[name]
        rows.append(Row(**TimedRow.timing_fields(name, t, tokens_per_step), params_bytes=mem["params"],
                        grads_bytes=mem["grads"], optimizer_bytes=mem["optimizer"],
                        activation_bytes=mem["activations"]))
    return rows


def round_order(round_index: int) -> list[Impl]:
    """Shardwise first in even rounds, torch first in odd ones."""
    return rotation([Impl.SHARDWISE, Impl.TORCH], round_index)


def warmup_mismatch(losses: Sequence[tuple[float, float]],
                    grads: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
                    rtol: float) -> tuple[float, float, str]:
    """Compare the warm-up of shardwise and torch on the same batches: the largest |loss difference| / |torch
    loss| over the steps (`losses`: (shardwise, torch) per step), and for the first step's gradients (parameter
    name -> local shard) the largest |difference| over all shards / the largest |torch gradient| (one scale
    for all tensors: a tensor whose gradients are all tiny would otherwise be judged on rounding noise).
    Returns the two relative differences and a message saying what is past `rtol` (empty: all agree)."""
    loss_rel, first_bad = 0.0, ""
    for i, (ours, theirs) in enumerate(losses):
        rel = abs(ours - theirs) / max(abs(theirs), 1e-30)
        loss_rel = max(loss_rel, rel)
        if rel > rtol and not first_bad:
            first_bad = f"step {i + 1} loss {ours!r} vs torch {theirs!r} (relative difference {rel:.2e})"
    g_ours, g_theirs = grads
    if g_ours.keys() != g_theirs.keys():
        return loss_rel, float("inf"), (f"the two models name their parameters differently: "
                                        f"{sorted(g_ours.keys() ^ g_theirs.keys())[:4]}")
    scale = max((float(g.abs().max()) for g in g_theirs.values() if g.numel()), default=0.0)
    worst, where = 0.0, ""
    for name, g in g_theirs.items():
        mine = g_ours[name]
        if mine.shape != g.shape:
            return loss_rel, float("inf"), (f"{name}: shardwise holds a {tuple(mine.shape)} shard, torch "
                                            f"{tuple(g.shape)}")
        diff = float((mine - g).abs().max()) if g.numel() else 0.0
        if diff > worst:
            worst, where = diff, name
    grad_rel = worst / max(scale, 1e-30)
    problems = [first_bad] if first_bad else []
    if grad_rel > rtol:
        problems.append(f"step 1 gradient of {where}: max |difference| {worst:.2e} = {grad_rel:.2e} of the largest "
                        f"gradient")
    message = ("warm-up on the same batches: " + "; ".join(problems) + f" > --rtol {rtol:g}; the two trainers do "
               "not compute the same training, so their times are not comparable") if problems else ""
    return loss_rel, grad_rel, message


# -- arguments ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch.distributed.run --nproc-per-node T -m benchmarks.tp",
        description="Tensor-parallel step time of shardwise against torch DTensor parallelize_module on one GPT.")
    p.add_argument("--d-model", type=int_at_least(8), default=256, help="(default: %(default)s)")
    p.add_argument("--heads", type=int_at_least(1), default=8, help="(default: %(default)s)")
    p.add_argument("--layers", type=int_at_least(1), default=4, help="transformer blocks (default: %(default)s)")
    p.add_argument("--seq", type=int_at_least(1), default=128, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--vocab", type=int_at_least(2), default=256, help="vocabulary size (default: %(default)s)")
    p.add_argument("--micro-batch", type=int_at_least(1), default=4, help="sequences per step, the same on every "
                   "rank of the TP group (default: %(default)s)")
    p.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism in both trainers")
    add_side_by_side_args(p, warmup=3, compared="losses (and the first step's gradients)")
    return p


def check_args(args: argparse.Namespace, nproc: int) -> None:
    """Reject shapes the TP size does not split (both trainers need whole heads and even shards)."""
    if nproc < 2:
        raise ValueError(f"tp benchmark: --nproc must be >= 2 (tensor parallelism over {nproc} rank splits "
                         f"nothing); got {nproc}. Use --nproc 2 or more.")
    if args.d_model % args.heads:
        raise ValueError(f"--d-model = {args.d_model} must be a multiple of --heads = {args.heads}")
    for flag, value in (("--heads", args.heads), ("--d-model", args.d_model), ("--vocab", args.vocab)):
        if value % nproc:
            raise ValueError(f"{flag} = {value} must be a multiple of --nproc = {nproc} (each rank holds "
                             f"{flag[2:]} / {nproc}); e.g. {flag} {nproc * max(1, value // nproc)}")
    if args.sequence_parallel and args.seq % nproc:
        raise ValueError(f"--seq = {args.seq} must be a multiple of --nproc = {nproc} with --sequence-parallel "
                         f"(each rank holds seq / {nproc} positions between blocks)")


# -- measurement --------------------------------------------------------------------------------------

def _check_warmup(trainers: dict[Impl, Any], warmup: int, rtol: float) -> dict[str, Any]:
    """The warm-up, step by step on the same batches: every step's losses and the first step's gradients must
    agree within `rtol` on every rank, or this raises."""
    sw, th = trainers[Impl.SHARDWISE], trainers[Impl.TORCH]
    g_sw: dict[str, torch.Tensor] = {}
    g_th: dict[str, torch.Tensor] = {}
    pairs = [(float(sw.step(g_sw)), float(th.step(g_th)))]
    for _ in range(warmup - 1):
        pairs.append((float(sw.step()), float(th.step())))
    loss_rel, grad_rel, message = warmup_mismatch(pairs, (g_sw, g_th), rtol)
    del g_sw, g_th
    failed = torch.tensor([float(bool(message))])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise RuntimeError(message or "tp benchmark: the warm-up differs on another rank (see its error)")
    return {"rtol": rtol, "loss_rel_diff": loss_rel, "grad_rel_diff": grad_rel, "passed": True,
            "warmup_losses": [{"shardwise": a, "torch": b} for a, b in pairs]}


def _time(trainers: dict[Impl, Any], rounds: int, steps: int) -> dict[str, list[list[float]]]:
    """Step times [trainer][round][step] in seconds, each the slowest rank's."""
    names = list(Impl)
    times = torch.zeros(rounds, len(names), steps, dtype=torch.float64)   # this rank's seconds
    for r in range(rounds):
        for impl in round_order(r):
            j = names.index(impl)
            for s in range(steps):
                dist.barrier()          # start together: no rank's wait for a peer counts in the next step
                t0 = time.perf_counter()
                trainers[impl].step()
                times[r, j, s] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {impl.value: times[:, j, :].tolist() for j, impl in enumerate(names)}


def print_table(rows: Sequence[Row], *, title: str, rss: Sequence[int], loss_check: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def mib(n: int) -> str:
        return f"{n / MIB:.2f} MiB"

    table = Table(title=title)
    for col in ("trainer", "median step ms", "round medians ms", "tokens/s", "shardwise / this", "paired",
                "params", "grads", "optimizer", "model states", "saved activations"):
        table.add_column(col, justify="left" if col == "trainer" else "right")
    for r in rows:
        table.add_row(r.trainer, f"{r.median_ms:.2f}", f"{r.round_min_ms:.2f} - {r.round_max_ms:.2f}",
                      f"{r.tokens_per_s:,.0f}", f"{r.shardwise_ratio:.3f}", f"{r.paired_ratio:.3f}",
                      mib(r.params_bytes), mib(r.grads_bytes), mib(r.optimizer_bytes), mib(r.model_states_bytes),
                      mib(r.activation_bytes))
    console = Console() if sys.stdout.isatty() else Console(width=180)   # a log file: do not wrap at 80
    console.print(table)
    console.print(f"Warm-up agrees: {len(loss_check['warmup_losses'])} steps' losses within "
                  f"{loss_check['loss_rel_diff']:.1e}, first-step gradients within {loss_check['grad_rel_diff']:.1e} "
                  f"relative difference (rtol {loss_check['rtol']:g}). "
                  f"shardwise / this: ratio of "
                  f"median step times (< 1: shardwise faster); paired: median over rounds of the ratio within "
                  f"each round. Memory on rank 0, from each trainer's own tensors: model states (parameters, "
                  f"gradients, AdamW moments) and the activations one forward saves for backward. Peak RSS per "
                  f"rank (whole process, both trainers): {', '.join(mib(b) for b in rss)}")


def run(args: argparse.Namespace) -> list[Row]:
    """Build, check, time and report on the already initialized default group; rank 0 prints and writes JSON."""
    import copy

    from benchmarks import tp_trainers as tt
    from shardwise.models import gpt_num_params
    data = tt.batches(args)
    full = tt.full_gpt(args)
    torch_copy = copy.deepcopy(full)           # before the engine splits `full` in place
    trainers = {Impl.SHARDWISE: tt.build_shardwise(full, args, data),
                Impl.TORCH: tt.build_torch(torch_copy, args, data)}
    del full, torch_copy
    loss_check = _check_warmup(trainers, args.warmup, args.rtol)
    times = _time(trainers, args.rounds, args.steps)
    memory = {impl.value: dict(t.memory(), activations=tt.saved_activation_bytes(t, data[0]))
              for impl, t in trainers.items()}
    rows = summarize(times, memory, tokens_per_step=args.micro_batch * args.seq)
    rss = rss_per_rank()
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        cfg = tt.gpt_cfg(args)
        title = (f"tensor parallel T = {world}{' + sequence parallel' if args.sequence_parallel else ''}, GPT "
                 f"d={args.d_model} heads={args.heads} L={args.layers} ({gpt_num_params(cfg):,} params), micro-batch "
                 f"{args.micro_batch} x {args.seq} tokens, gloo, CPU, {torch.get_num_threads()} thread(s)/rank: "
                 f"median of {args.rounds} alternating rounds x {args.steps} steps")
        print_table(rows, title=title, rss=rss, loss_check=loss_check)
        if args.json is not None:
            meta = args_meta(args)
            meta.update(world_size=world, threads_per_rank=torch.get_num_threads(), torch_version=torch.__version__,
                        shardwise_config=tt.engine_config(args, world))
            out = {"config": meta, "loss_check": loss_check,
                   "rows": [dict(asdict(r), model_states_bytes=r.model_states_bytes) for r in rows],
                   "peak_rss_bytes_per_rank": rss, "step_times_s": times}
            write_json(args.json, out)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank under torch.distributed.run (it sets RANK, WORLD_SIZE, MASTER_ADDR)."""
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: python -m torch.distributed.run --nproc-per-node 2 "
              "-m benchmarks.tp (or `shardwise bench tp --nproc 2`)", file=sys.stderr)
        return 2
    check_args(args, int(os.environ["WORLD_SIZE"]))
    return run_in_gloo_group(run, args)     # one thread per rank, barrier before teardown


def launch(nproc: int, argv: Sequence[str] = ()) -> int:
    """Run this benchmark on `nproc` local ranks via torch's elastic launcher, one thread per rank; returns
    its exit code. `argv` are this module's own options (e.g. ["--d-model", "256", "--json", "tp.json"])."""
    check_args(build_parser().parse_args(list(argv)), nproc)   # reject bad options here, not on every rank
    return run_under_launcher("benchmarks.tp", nproc, argv, threads_per_rank=1)


if __name__ == "__main__":
    from shardwise.engine.initialize import exit_rank
    exit_rank(main())
