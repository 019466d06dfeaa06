"""The module wrappers' step time and memory: shardwise's `fully_shard` against torch FSDP2's, shardwise's
`DistributedDataParallel` against torch DDP, on one GPT, side by side.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.fsdp \\
        --model small --micro-batch 4 --rounds 6 --steps 5 --warmup 2 [--bf16] --json fsdp.json

Every rank builds the four trainers (`wrapper_trainers.py`) of one GPT from one seed. Correctness first: the
`--warmup` untimed steps of each pair run on the same micro-batches and their losses must agree within `--rtol`
(the same training), or the run stops. Then `--rounds` rounds run `--steps` timed steps of each trainer, the
order rotated every round (ABCD, BCDA, ...); every step starts after a barrier and lasts as long as its slowest
rank. Per trainer: the median step time, the spread of the per-round medians, global tokens/s, the ratio of the
medians to its peer's (this / peer: < 1, this one is faster) and the paired ratio (median over rounds of the
ratio within a round, which cancels load that drifts between rounds on a shared machine).

Memory: the trainers share a process per rank, so peak RSS (reported once per rank) cannot be split between
them. Per trainer the table gives its model states on rank 0, from its own tensors: parameters (shards for the
FSDP pair), gradients (between backward and the step) and AdamW moments.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import (
    TimedRow, args_meta, compare_times, int_at_least, positive_float, rotation, rss_per_rank, run_in_gloo_group,
    run_under_launcher, sequence_length, write_json,
)
from benchmarks.trainers import MIB, Built, batches
from benchmarks.wrapper_trainers import BUILDERS, Wrapper

MODELS = ("tiny", "small")
PAIRS = {"fsdp": (Wrapper.SW_FSDP, Wrapper.FSDP2), "ddp": (Wrapper.SW_DDP, Wrapper.SW_DDP_GLOO, Wrapper.DDP)}


@dataclass(frozen=True)
class Row(TimedRow):
    """One trainer: timing columns (`shardwise_ratio` / `paired_ratio` against its peer, this / peer) and its
    model states on rank 0 in bytes."""

    peer: str
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def summarize(times_s: dict[str, list[list[float]]], memory: dict[str, dict[str, int]], *,
              tokens_per_step: int) -> list[Row]:
    """Rows from `times_s[trainer][round][step]` (seconds) and `memory[trainer]`; each ratio against the peer."""
    rows = []
    for w in Wrapper:
        if w.value not in times_s or w.peer.value not in times_s:
            continue
        pair = {w.value: times_s[w.value], w.peer.value: times_s[w.peer.value]}
        t = compare_times(pair, w.value)[w.peer.value]        # w's median / the peer's median
        own = compare_times(pair, w.value)[w.value]
        mem = memory[w.value]
        rows.append(Row(**dict(TimedRow.timing_fields(w.value, own, tokens_per_step), shardwise_ratio=t.ratio,
                               paired_ratio=t.paired_ratio), peer=w.peer.value, params_bytes=mem["params"],
                        grads_bytes=mem["grads"], optimizer_bytes=mem["optimizer"]))
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch.distributed.run --nproc-per-node N -m benchmarks.fsdp",
                                description="shardwise fully_shard / DistributedDataParallel vs torch FSDP2 / DDP.")
    p.add_argument("--model", choices=MODELS, default="tiny", help="GPT preset (default: %(default)s)")
    p.add_argument("--micro-batch", type=int_at_least(1), default=4, help="sequences per rank per step "
                   "(default: %(default)s)")
    p.add_argument("--seq-len", type=int_at_least(1), default=None, help="tokens per sequence (default: the "
                   "preset's)")
    p.add_argument("--bucket-mb", type=positive_float(), default=25.0, help="DDP bucket cap in MiB, both DDPs "
                   "(default: %(default)s)")
    p.add_argument("--bf16", action="store_true", help="FSDP pair: bf16 parameters, fp32 reduction")
    p.add_argument("--pairs", choices=PAIRS, nargs="+", default=list(PAIRS), help="which pairs to build and time "
                   "(default: both); one pair alone affords more rounds in the same time")
    p.add_argument("--rounds", type=int_at_least(1), default=6, help="(default: %(default)s)")
    p.add_argument("--steps", type=int_at_least(1), default=5, help="timed steps per trainer per round "
                   "(default: %(default)s)")
    p.add_argument("--warmup", type=int_at_least(1), default=2, help="untimed steps of each, losses compared "
                   "(default: %(default)s)")
    p.add_argument("--rtol", type=positive_float(), default=None, help="largest relative difference of the "
                   "warm-up losses within a pair (default: 1e-5, or 1e-2 with --bf16)")
    p.add_argument("--memory-only", choices=[w.value for w in Wrapper], default=None, metavar="TRAINER",
                   help="build only TRAINER, run --warmup + --steps steps, report each rank's peak RSS above what it "
                   "held before building the model (one launch per trainer: their peaks then do not mix)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results to OUT")
    return p


def _rss_now() -> int:
    """This process's resident set size now, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def run_memory_only(args: argparse.Namespace) -> dict[str, Any]:
    """One trainer alone: peak RSS per rank above the rank's RSS before the model was built (the imports, the
    process group and the batches), after --warmup + --steps steps; its model states from its own tensors."""
    import resource
    from shardwise.models import gpt_config
    w = Wrapper(args.memory_only)
    data = batches(args, args.seq_len, gpt_config(args.model).vocab_size)
    base = _rss_now()
    trainer = BUILDERS[w](args, data)
    for _ in range(args.warmup + args.steps):
        trainer.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    states = trainer.memory()
    growth = torch.tensor([peak - base], dtype=torch.int64)
    gathered = [torch.zeros_like(growth) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, growth)
    out = {"trainer": w.value, "peak_rss_growth_bytes_per_rank": [int(t) for t in gathered], "model_states": states}
    if dist.get_rank() == 0:
        print(f"{w.value}: peak RSS above the pre-model baseline per rank: "
              f"{', '.join(f'{int(t) / MIB:.1f} MiB' for t in gathered)}; model states "
              f"{sum(v for v in states.values()) / MIB:.2f} MiB")
        if args.json is not None:
            write_json(args.json, dict(out, config=args_meta(args)))
    return out


def _check_warmup(trainers: dict[Wrapper, Built], warmup: int, rtol: float) -> dict[str, Any]:
    """Untimed steps of every trainer on the same micro-batches; each pair's losses must agree within rtol."""
    losses = {w: [] for w in trainers}
    for _ in range(warmup):
        for w, t in trainers.items():
            loss = t.forward()
            t.backward(loss)
            t.update()
            losses[w].append(float(loss.detach()))
    worst = 0.0
    for w in trainers:
        for a, b in zip(losses[w], losses.get(w.peer, [])):
            worst = max(worst, abs(a - b) / abs(b))
    failed = torch.tensor([float(worst > rtol)])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise RuntimeError(f"warm-up losses differ within a pair by {worst:.2e} > --rtol {rtol:g}: the trainers do "
                           f"not compute the same training, so their times are not comparable")
    return {"rtol": rtol, "loss_rel_diff": worst, "losses": {w.value: v for w, v in losses.items()}}


def _time(trainers: dict[Wrapper, Built], rounds: int, steps: int) -> dict[str, list[list[float]]]:
    names = list(trainers)
    times = torch.zeros(rounds, len(names), steps, dtype=torch.float64)
    for r in range(rounds):
        for w in rotation(names, r):
            j = names.index(w)
            for s in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                trainers[w].step()
                times[r, j, s] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {w.value: times[:, j, :].tolist() for j, w in enumerate(names)}


def print_table(rows: Sequence[Row], *, title: str, rss: Sequence[int], check: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    mib = lambda n: f"{n / MIB:.2f} MiB"  # noqa: E731
    table = Table(title=title)
    for col in ("trainer", "median step ms", "round medians ms", "tokens/s", "this / peer", "paired", "params",
                "grads", "optimizer", "model states"):
        table.add_column(col, justify="left" if col == "trainer" else "right")
    for r in rows:
        table.add_row(r.trainer, f"{r.median_ms:.2f}", f"{r.round_min_ms:.2f} - {r.round_max_ms:.2f}",
                      f"{r.tokens_per_s:,.0f}", f"{r.shardwise_ratio:.3f}", f"{r.paired_ratio:.3f}",
                      mib(r.params_bytes), mib(r.grads_bytes), mib(r.optimizer_bytes), mib(r.model_states_bytes))
    console = Console() if sys.stdout.isatty() else Console(width=180)
    console.print(table)
    console.print(f"Warm-up losses agree within each pair: {check['loss_rel_diff']:.1e} (rtol {check['rtol']:g}). "
                  f"this / peer: ratio of median step times (< 1: faster than its peer); paired: median over rounds "
                  f"of the ratio within a round. Peak RSS per rank (whole process, all trainers): "
                  f"{', '.join(mib(b) for b in rss)}")


def run(args: argparse.Namespace) -> list[Row]:
    from shardwise.models import gpt_config, gpt_num_params
    cfg = gpt_config(args.model)
    data = batches(args, args.seq_len, cfg.vocab_size)
    chosen = [w for pair in args.pairs for w in PAIRS[pair]]
    trainers = {w: BUILDERS[w](args, data) for w in Wrapper if w in chosen}
    rtol = args.rtol if args.rtol is not None else (1e-2 if args.bf16 else 1e-5)
    check = _check_warmup(trainers, args.warmup, rtol)
    times = _time(trainers, args.rounds, args.steps)
    memory = {w.value: t.memory() for w, t in trainers.items()}
    world = dist.get_world_size()
    rows = summarize(times, memory, tokens_per_step=args.micro_batch * args.seq_len * world)
    rss = rss_per_rank()
    if dist.get_rank() == 0:
        title = (f"{world} ranks, GPT {args.model} ({gpt_num_params(cfg):,} params), micro-batch {args.micro_batch} x "
                 f"{args.seq_len} tokens per rank, {'bf16 params / fp32 reduce' if args.bf16 else 'fp32'}, gloo, "
                 f"CPU, {torch.get_num_threads()} thread(s)/rank: median of {args.rounds} rotated rounds x "
                 f"{args.steps} steps")
        print_table(rows, title=title, rss=rss, check=check)
        if args.json is not None:
            meta = dict(args_meta(args), world_size=world, torch_version=torch.__version__)
            write_json(args.json, {"config": meta, "loss_check": check, "step_times_s": times,
                                   "rows": [dict(asdict(r), model_states_bytes=r.model_states_bytes) for r in rows],
                                   "peak_rss_bytes_per_rank": rss})
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    from shardwise.models import gpt_config
    args.seq_len = sequence_length(parser, args.seq_len, gpt_config(args.model).seq_len, flag="--seq-len",
                                   model=args.model)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: python -m torch.distributed.run --nproc-per-node 2 "
              "-m benchmarks.fsdp (or `shardwise bench fsdp --nproc 2`)", file=sys.stderr)
        return 2
    return run_in_gloo_group(run_memory_only if args.memory_only else run, args)


def launch(nproc: int, argv: Sequence[str] = ()) -> int:
    """Run this benchmark on `nproc` local ranks through torch's elastic launcher, one thread per rank."""
    parse_args(list(argv))                       # reject bad options here, not on every rank
    if nproc < 2:
        raise ValueError(f"--nproc = {nproc}: the wrappers shard or replicate over ranks; use --nproc 2 or more")
    return run_under_launcher("benchmarks.fsdp", nproc, argv, threads_per_rank=1)


if __name__ == "__main__":
    from shardwise.engine.initialize import exit_rank
    exit_rank(main())
