"""Data-parallel step time: shardwise against torch DDP, torch FSDP2 and DeepSpeed at one ZeRO stage, side by side.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.dp \\
        --model tiny --steps 10 --warmup 3 --rounds 5 --micro-batch 4 [--zero-stage 0-3] [--offload] \\
        [--persistence-threshold N] --json dp.json

Every rank builds the trainers (`benchmarks.trainers`) of one GPT from one seed and one DeepSpeed JSON
(AdamW, gradient clipping, the same gradient bucket size, `--zero-stage`, and with `--offload` the optimizer on
the CPU): shardwise (`shardwise.initialize`); at stage 0 torch DDP (same bucket cap, gradient_as_bucket_view,
torch.optim.AdamW, clip_grad_norm_); at stage 3 torch FSDP2 (`fully_shard` on each block, then the root; the same
AdamW and clipping); DeepSpeed (`deepspeed.initialize`, `torch_adam` so it steps the same torch AdamW, also when
offloaded: no CPUAdam JIT build). After `--warmup` untimed steps of each, `--rounds` rounds run `--steps` timed
steps of each trainer in turn; the order rotates every round (ABC, BCA, CAB, ...) so that machine noise and
whatever a trainer leaves in the caches hit all of them alike. A step's time is the slowest rank's. The report
gives per trainer the median step time, the spread of the per-round medians, global tokens/s, and the step-time
ratio shardwise/this (< 1: shardwise is faster), both of the overall medians and paired (the median over rounds
of the ratio within a round, which cancels load that drifts between rounds), and the median of each phase of a
step: forward, backward (with the gradient communication the trainer does during or right after it) and update
(clipping, optimizer step, parameter all-gather, zeroing). DeepSpeed's stage 0 ignores
`reduce_bucket_size`: it all-reduces every gradient after backward, so its communication never overlaps backward.

Memory: the trainers share one process per rank, so peak RSS cannot be split between them. The table gives each
trainer's model states instead (parameters, gradient buffers, optimizer state with any fp32 master copy), measured
from its own tensors (see `trainers.py`); transient buffers (gathered stage-3 units, DeepSpeed's flat all-reduce
copies) are not counted. Peak RSS is reported once per rank, for the whole process.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import (
    TimedRow, args_meta, compare_times, int_at_least, positive_float, rotation, rss_per_rank, run_under_launcher,
    sequence_length, write_json,
)
from benchmarks.trainers import BUILDERS, MIB, Built, Memory, Trainer, batches

MODELS = ("tiny", "small")


@dataclass(frozen=True)
class Row(TimedRow):
    """One trainer's figures: the timing columns (tokens_per_s counts global tokens) and, in bytes, this rank's
    model states."""

    params_bytes: int | None       # None: not measurable honestly for this trainer (see trainers.py)
    grads_bytes: int | None
    optimizer_bytes: int | None

    @property
    def model_states_bytes(self) -> int | None:
        parts = (self.params_bytes, self.grads_bytes, self.optimizer_bytes)
        return None if None in parts else sum(parts)   # type: ignore[arg-type]


# -- pure summary -------------------------------------------------------------------------------------

def summarize(times_s: dict[str, list[list[float]]], memory: dict[str, Memory], *,
              tokens_per_step: int) -> list[Row]:
    """Rows from per-trainer step times `times_s[trainer][round][step]` (seconds) and model-state bytes.
    The ratio column needs a "shardwise" entry."""
    rows = []
    for name, t in compare_times(times_s, Trainer.SHARDWISE.value).items():
        mem = memory[name]
        rows.append(Row(**TimedRow.timing_fields(name, t, tokens_per_step), params_bytes=mem["params"],
                        grads_bytes=mem["grads"], optimizer_bytes=mem["optimizer"]))
    return rows


# -- arguments ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch.distributed.run --nproc-per-node N -m benchmarks.dp",
        description="Step time of shardwise stage 0 against torch DDP and DeepSpeed stage 0 on one GPT.")
    p.add_argument("--model", choices=MODELS, default="tiny", help="GPT preset (default: %(default)s)")
    p.add_argument("--steps", type=int_at_least(1), default=10, help="timed steps per trainer per round "
                   "(default: %(default)s)")
    p.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed steps of each trainer first "
                   "(default: %(default)s)")
    p.add_argument("--rounds", type=int_at_least(1), default=5, help="rounds of (steps x each trainer) "
                   "(default: %(default)s)")
    p.add_argument("--micro-batch", type=int_at_least(1), default=4, help="sequences per rank per step "
                   "(default: %(default)s)")
    p.add_argument("--seq-len", type=int_at_least(1), default=None, help="tokens per sequence (default: the "
                   "preset's seq_len; at most that)")
    p.add_argument("--bucket-mb", type=positive_float(), default=4.0, help="gradient bucket size in MiB of fp32, "
                   "for shardwise (reduce_bucket_size) and DDP (bucket_cap_mb) (default: %(default)s)")
    p.add_argument("--trainers", nargs="+", choices=[t.value for t in Trainer], default=None,
                   help="which trainers to run; shardwise is always included (default: all three, or shardwise and "
                        "ddp when deepspeed is not installed)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=0,
                   help="ZeRO stage of shardwise and DeepSpeed; DDP runs only at stage 0, FSDP2 only at stage 3 "
                        "(default: %(default)s)")
    p.add_argument("--offload", action="store_true", help="optimizer states and step on the CPU "
                   '(zero_optimization.offload_optimizer.device "cpu"), stages 1-3')
    p.add_argument("--persistence-threshold", type=int_at_least(0), default=None, metavar="N",
                   help="stage 3: zero_optimization.stage3_param_persistence_threshold for shardwise and DeepSpeed "
                        "(parameters of at most N elements stay whole on every rank; FSDP2 has no such rule, i.e. "
                        "0) (default: DeepSpeed's, 100000)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results to OUT")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and check the options; a bad value exits 2 with argparse's one-line message. Fills in
    `args.seq_len` (the preset's when not given)."""
    from shardwise.models import gpt_config
    parser = build_parser()
    args = parser.parse_args(argv)
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    if args.offload and args.zero_stage == 0:
        parser.error("--offload with --zero-stage 0: stage 0 has no partitioned optimizer to offload; "
                     "use --zero-stage 1, 2 or 3")
    if args.persistence_threshold is not None and args.zero_stage != 3:
        parser.error(f"--persistence-threshold with --zero-stage {args.zero_stage}: only stage 3 keeps small "
                     f"parameters whole; use --zero-stage 3 or leave it out")
    if args.trainers is None:
        args.trainers = [t.value for t in Trainer if (t is not Trainer.DEEPSPEED or has_deepspeed)
                         and args.zero_stage in t.stages]
    elif misfit := [t for t in args.trainers if args.zero_stage not in Trainer(t).stages]:
        t = Trainer(misfit[0])
        parser.error(f"--trainers {t.value} with --zero-stage {args.zero_stage}: {t.value} has a counterpart only at "
                     f"stage(s) {', '.join(map(str, t.stages))}; leave it out")
    elif Trainer.DEEPSPEED.value in args.trainers and not has_deepspeed:
        parser.error("--trainers deepspeed: DeepSpeed is not installed (pip install deepspeed, or leave it out)")
    args.seq_len = sequence_length(parser, args.seq_len, gpt_config(args.model).seq_len, flag="--seq-len",
                                   model=args.model)
    return args


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    """The one DeepSpeed JSON all trainers follow (DDP by hand: same optimizer, clip and bucket size)."""
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage, "reduce_bucket_size": int(args.bucket_mb * MIB) // 4,
                              **({"offload_optimizer": {"device": "cpu"}} if args.offload else {}),
                              **({"stage3_param_persistence_threshold": args.persistence_threshold}
                                 if args.persistence_threshold is not None else {})},
        "steps_per_print": 1 << 30,
    }


# -- measurement --------------------------------------------------------------------------------------

PHASES = ("forward", "backward", "update")


def measure(trainers: dict[str, Built], *, rounds: int, steps: int, warmup: int
            ) -> tuple[dict[str, list[list[float]]], dict[str, dict[str, float]]]:
    """Step times [trainer][round][step] in seconds, each the slowest rank's; and per trainer the median seconds
    of each phase (`PHASES`; per step the slowest rank's, so the three need not add up to the step)."""
    names = list(trainers)
    for name in names:
        for _ in range(warmup):
            trainers[name].step()
    # times: [rounds, trainers, steps, 1 + phases] on this rank: the step, then its phases
    times = torch.zeros(rounds, len(names), steps, 1 + len(PHASES), dtype=torch.float64)
    for r in range(rounds):
        for name in rotation(names, r):
            dist.barrier()          # start each block together, so no rank's wait counts as the next step's
            j, built = names.index(name), trainers[name]
            for s in range(steps):
                t0 = time.perf_counter()
                loss = built.forward()
                t1 = time.perf_counter()
                built.backward(loss)
                t2 = time.perf_counter()
                built.update()
                t3 = time.perf_counter()
                times[r, j, s] = torch.tensor([t3 - t0, t1 - t0, t2 - t1, t3 - t2], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    phases = {name: {ph: float(times[:, j, :, 1 + k].median()) for k, ph in enumerate(PHASES)}
              for j, name in enumerate(names)}
    return {name: times[:, j, :, 0].tolist() for j, name in enumerate(names)}, phases


def print_table(rows: Sequence[Row], *, title: str, rss: Sequence[int], phases: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    def mib(n: int | None) -> str:
        return "n/a" if n is None else f"{n / MIB:.1f} MiB"

    table = Table(title=title)
    for col in ("trainer", "median step ms", "round medians ms", "tokens/s", "shardwise / this", "paired",
                *(f"{ph} ms" for ph in PHASES), "params", "grads", "optimizer", "model states"):
        table.add_column(col, justify="left" if col == "trainer" else "right")
    for r in rows:
        table.add_row(r.trainer, f"{r.median_ms:.2f}", f"{r.round_min_ms:.2f} - {r.round_max_ms:.2f}",
                      f"{r.tokens_per_s:,.0f}", f"{r.shardwise_ratio:.3f}",
                      f"{r.paired_ratio:.3f}", *(f"{phases[r.trainer][ph] * 1e3:.1f}" for ph in PHASES),
                      mib(r.params_bytes), mib(r.grads_bytes), mib(r.optimizer_bytes), mib(r.model_states_bytes))
    console = Console() if sys.stdout.isatty() else Console(width=200)   # a log file: do not wrap at 80
    console.print(table)
    console.print("shardwise / this: ratio of median step times (< 1: shardwise faster); paired: median over rounds "
                  "of the same ratio within each round. forward / backward / update: median of each phase of a step "
                  "(backward includes the gradient communication a trainer does there; update: clipping, optimizer "
                  "step, parameter all-gather). Memory: each trainer's model states on one rank, from its "
                  "own tensors (params: parameters held between steps; grads: gradient buffers; optimizer: moments "
                  "plus any separate fp32 master copy; n/a: no honest measure); the trainers share a process, so "
                  "RSS is not per trainer. "
                  f"Peak RSS per rank (whole process): {', '.join(mib(b) for b in rss)}")


def run(args: argparse.Namespace) -> list[Row]:
    """Build, time and report on the already initialized default group; rank 0 prints and writes JSON."""
    from shardwise.models import gpt_config, gpt_num_params
    preset, seq_len = gpt_config(args.model), args.seq_len
    config = ds_config(args)
    data = batches(args, seq_len, preset.vocab_size)
    wanted = [Trainer.SHARDWISE] + [t for t in Trainer if t is not Trainer.SHARDWISE and t.value in args.trainers]
    trainers = {t.value: BUILDERS[t](args, config, data) for t in wanted}
    times, phases = measure(trainers, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    memory = {name: built.memory() for name, built in trainers.items()}
    world = dist.get_world_size()
    rows = summarize(times, memory, tokens_per_step=args.micro_batch * seq_len * world)
    rss = rss_per_rank()
    if dist.get_rank() == 0:
        keep = "" if args.persistence_threshold is None else f" (persistence threshold {args.persistence_threshold})"
        title = (f"ZeRO stage {args.zero_stage}{keep}{' + CPU optimizer offload' if args.offload else ''}, "
                 f"{args.model} GPT ({gpt_num_params(preset):,} params), "
                 f"{world} ranks x micro-batch {args.micro_batch} x {seq_len} tokens, gloo, "
                 f"{torch.get_num_threads()} thread(s)/rank: median of {args.rounds} rounds x {args.steps} steps")
        print_table(rows, title=title, rss=rss, phases=phases)
        if args.json is not None:
            meta = args_meta(args)
            meta.update(world_size=world, seq_len=seq_len, threads_per_rank=torch.get_num_threads(),
                        ds_config=config)
            out = {"config": meta, "rows": [dict(asdict(r), model_states_bytes=r.model_states_bytes) for r in rows],
                   "peak_rss_bytes_per_rank": rss, "step_times_s": times, "phase_median_s": phases}
            write_json(args.json, out)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank under torch.distributed.run (it sets RANK, WORLD_SIZE, MASTER_ADDR)."""
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: python -m torch.distributed.run --nproc-per-node 2 "
              "-m benchmarks.dp (or `shardwise bench dp --nproc 2`)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)      # one core per rank: the ranks share the machine's cores
    dist.init_process_group("gloo")
    try:
        run(args)
    finally:
        dist.destroy_process_group()
    return 0


def launch(nproc: int, argv: Sequence[str] = ()) -> int:
    """Run this benchmark on `nproc` local ranks via torch's elastic launcher, one thread per rank; returns
    its exit code. `argv` are this module's own options (e.g. ["--model", "small", "--json", "dp.json"])."""
    if nproc < 2:
        raise ValueError(f"dp benchmark: --nproc must be >= 2 (data parallelism over {nproc} rank communicates "
                         f"nothing); got {nproc}. Use --nproc 2 or more.")
    parse_args(list(argv))        # reject bad options here, not on every rank
    return run_under_launcher("benchmarks.dp", nproc, argv, threads_per_rank=1)


if __name__ == "__main__":
    from shardwise.engine.initialize import exit_rank
    exit_rank(main())
