"""Data-parallel step time: shardwise stage 0 against torch DDP and DeepSpeed stage 0, side by side.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 -m shardwise.benchmarks.dp \\
        --model tiny --steps 10 --warmup 3 --rounds 5 --micro-batch 4 --json dp.json

Every rank builds the three trainers of one GPT from one seed and one DeepSpeed JSON (AdamW, gradient clipping,
the same gradient bucket size): shardwise (`shardwise.initialize`), torch DDP (same bucket cap,
gradient_as_bucket_view, torch.optim.AdamW, clip_grad_norm_) and DeepSpeed (`deepspeed.initialize`, stage 0,
`torch_adam` so it steps the same torch AdamW). After `--warmup` untimed steps of each, `--rounds` rounds run
`--steps` timed steps of each trainer in turn; the order rotates every round (ABC, BCA, CAB, ...) so that machine
noise and whatever a trainer leaves in the caches hit all of them alike. A step's time is the slowest rank's.
The report gives per trainer the median step time, the spread of the per-round medians, global tokens/s, and the
step-time ratios shardwise/DDP and shardwise/DeepSpeed (< 1: shardwise is faster), both of the overall medians and
paired (the median over rounds of the ratio within a round, which cancels load that drifts between rounds).
DeepSpeed's stage 0 ignores `reduce_bucket_size`: it all-reduces every gradient after backward, in flat buffers of
up to 5e8 elements, so its communication never overlaps backward; shardwise and DDP launch buckets during it.

Memory: the trainers share one process per rank, so peak RSS cannot be split between them. The table gives
each trainer's model states instead (parameters, gradient buffers, optimizer state), measured from its own
tensors: `engine.memory_report()` for shardwise; the distinct storages behind `.grad` (DDP's reducer buckets,
as its gradients are views into them) and the optimizer's state tensors for DDP and DeepSpeed. DeepSpeed's
stage 0 also builds a transient flat copy of all gradients for each all-reduce; it is not counted. Peak RSS is
reported once per rank, for the whole process.
"""

from __future__ import annotations

import argparse
import copy
import enum
import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

MIB = 1 << 20
MODELS = ("tiny", "small")
_DATA_BATCHES = 4          # distinct random micro-batches per rank, cycled


class Trainer(str, enum.Enum):
    SHARDWISE = "shardwise"
    DDP = "ddp"
    DEEPSPEED = "deepspeed"


@dataclass(frozen=True)
class Row:
    """One trainer's figures. Times in ms; memory in bytes (this rank's model states)."""

    trainer: str
    median_ms: float              # median over every timed step (slowest rank's time)
    round_min_ms: float           # smallest and largest per-round median: the run-to-run spread
    round_max_ms: float
    tokens_per_s: float           # global tokens per second at the median step time
    shardwise_ratio: float        # shardwise median / this median (< 1: shardwise is faster)
    paired_ratio: float           # median over rounds of (shardwise round median / this round median): robust to
                                  # load that drifts between rounds, as each round's trainers ran back to back
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


@dataclass
class _Built:
    """A trainer ready to time: `step()` runs one full optimizer step on the next micro-batch."""

    step: Callable[[], None]
    memory: Callable[[], dict[str, int]]


# -- pure summary -------------------------------------------------------------------------------------

def summarize(times_s: dict[str, list[list[float]]], memory: dict[str, dict[str, int]], *,
              tokens_per_step: int) -> list[Row]:
    """Rows from per-trainer step times `times_s[trainer][round][step]` (seconds) and model-state bytes.
    The ratio column needs a "shardwise" entry."""
    medians = {name: statistics.median(t for rnd in rounds for t in rnd) for name, rounds in times_s.items()}
    ours = medians[Trainer.SHARDWISE.value]
    ours_per_round = [statistics.median(rnd) for rnd in times_s[Trainer.SHARDWISE.value]]
    rows = []
    for name, rounds in times_s.items():
        per_round = [statistics.median(rnd) for rnd in rounds]
        paired = statistics.median(a / b for a, b in zip(ours_per_round, per_round))
        mem = memory[name]
        rows.append(Row(trainer=name, median_ms=medians[name] * 1e3, round_min_ms=min(per_round) * 1e3,
                        round_max_ms=max(per_round) * 1e3, tokens_per_s=tokens_per_step / medians[name],
                        shardwise_ratio=ours / medians[name], paired_ratio=paired, params_bytes=mem["params"],
                        grads_bytes=mem["grads"], optimizer_bytes=mem["optimizer"]))
    return rows


def rotation(trainers: Sequence[str], round_index: int) -> list[str]:
    """Round r runs the trainers rotated left by r: ABC, BCA, CAB, ABC, ..."""
    k = round_index % len(trainers)
    return list(trainers[k:]) + list(trainers[:k])


# -- arguments ----------------------------------------------------------------------------------------

def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value
    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch.distributed.run --nproc-per-node N -m shardwise.benchmarks.dp",
        description="Step time of shardwise stage 0 against torch DDP and DeepSpeed stage 0 on one GPT.")
    p.add_argument("--model", choices=MODELS, default="tiny", help="GPT preset (default: %(default)s)")
    p.add_argument("--steps", type=_int_at_least(1), default=10, help="timed steps per trainer per round "
                   "(default: %(default)s)")
    p.add_argument("--warmup", type=_int_at_least(0), default=3, help="untimed steps of each trainer first "
                   "(default: %(default)s)")
    p.add_argument("--rounds", type=_int_at_least(1), default=5, help="rounds of (steps x each trainer) "
                   "(default: %(default)s)")
    p.add_argument("--micro-batch", type=_int_at_least(1), default=4, help="sequences per rank per step "
                   "(default: %(default)s)")
    p.add_argument("--seq-len", type=_int_at_least(1), default=None, help="tokens per sequence (default: the "
                   "preset's seq_len; at most that)")
    p.add_argument("--bucket-mb", type=_positive_float, default=4.0, help="gradient bucket size in MiB of fp32, "
                   "for shardwise (reduce_bucket_size) and DDP (bucket_cap_mb) (default: %(default)s)")
    p.add_argument("--trainers", nargs="+", choices=[t.value for t in Trainer], default=None,
                   help="which trainers to run; shardwise is always included (default: all three, or shardwise and "
                        "ddp when deepspeed is not installed)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=0,
                   help="ZeRO stage of shardwise and DeepSpeed; DDP runs only at stage 0 (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results to OUT")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and check the options; a bad value exits 2 with argparse's one-line message. Fills in
    `args.seq_len` (the preset's when not given)."""
    from shardwise.models import gpt_config
    parser = build_parser()
    args = parser.parse_args(argv)
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    if args.trainers is None:
        args.trainers = [t.value for t in Trainer if (t is not Trainer.DEEPSPEED or has_deepspeed)
                         and (t is not Trainer.DDP or args.zero_stage == 0)]
    elif Trainer.DDP.value in args.trainers and args.zero_stage > 0:
        parser.error(f"--trainers ddp with --zero-stage {args.zero_stage}: DDP replicates the optimizer; leave it out")
    elif Trainer.DEEPSPEED.value in args.trainers and not has_deepspeed:
        parser.error("--trainers deepspeed: DeepSpeed is not installed (pip install deepspeed, or leave it out)")
    limit = gpt_config(args.model).seq_len
    if args.seq_len is None:
        args.seq_len = limit
    elif args.seq_len > limit:
        parser.error(f"--seq-len {args.seq_len} exceeds the {args.model} preset's seq_len {limit} (its learned "
                     f"position table): use --seq-len {limit} or less")
    return args


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    """The one DeepSpeed JSON all trainers follow (DDP by hand: same optimizer, clip and bucket size)."""
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage, "reduce_bucket_size": int(args.bucket_mb * MIB) // 4},
        "steps_per_print": 1 << 30,
    }


# -- trainers -----------------------------------------------------------------------------------------

def _model(args: argparse.Namespace) -> torch.nn.Module:
    from shardwise.models import GPT, gpt_config
    torch.manual_seed(1234)
    return GPT(gpt_config(args.model))


def _batches(args: argparse.Namespace, seq_len: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches: (input ids [B, L], labels [B, L]) of random tokens."""
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    rows = [torch.randint(0, vocab, (args.micro_batch, seq_len + 1), generator=g) for _ in range(_DATA_BATCHES)]
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


def _cycle(batches: list) -> Callable[[], Any]:
    state = {"i": 0}

    def next_batch() -> Any:
        b = batches[state["i"] % len(batches)]
        state["i"] += 1
        return b
    return next_batch


def _storage_bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


def _model_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    return {"params": sum(p.numel() * p.element_size() for p in params),
            "grads": _storage_bytes([p.grad for p in params]), "optimizer": _optimizer_bytes(opt)}


def build_shardwise(args: argparse.Namespace, config: dict, batches: list) -> _Built:
    import shardwise
    model = _model(args)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))
    next_batch = _cycle(batches)

    def step() -> None:
        loss = engine(*next_batch())
        engine.backward(loss)
        engine.step()

    def memory() -> dict[str, int]:
        report = engine.memory_report()
        return {"params": report["params"], "grads": report["grads"], "optimizer": report["optimizer"]}
    return _Built(step, memory)


def build_ddp(args: argparse.Namespace, config: dict, batches: list) -> _Built:
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _model(args)
    # Same bucket cap as shardwise; gradients as views into the buckets (no copy in or out), as shardwise does.
    ddp = DDP(model, bucket_cap_mb=config["zero_optimization"]["reduce_bucket_size"] * 4 / MIB,
              gradient_as_bucket_view=True)
    params = config["optimizer"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], weight_decay=params["weight_decay"])
    clip = config["gradient_clipping"]
    next_batch = _cycle(batches)

    def step() -> None:
        opt.zero_grad(set_to_none=False)     # keep .grad as bucket views
        loss = ddp(*next_batch())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return _Built(step, lambda: _model_state_bytes(model, opt))


def build_deepspeed(args: argparse.Namespace, config: dict, batches: list) -> _Built:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    # Its shared-memory kernel serves only inference_all_reduce; skip the C++ JIT build.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = _model(args)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))
    next_batch = _cycle(batches)
    probe: dict[str, int] = {}

    def step(measure_grads: bool = False) -> None:
        loss = engine(*next_batch())
        engine.backward(loss)
        if measure_grads:   # DeepSpeed frees .grad in step(): its gradients exist from backward to step
            probe["grads"] = _storage_bytes([p.grad for p in engine.module.parameters()])
        engine.step()

    def memory() -> dict[str, int]:
        step(measure_grads=True)
        return dict(_model_state_bytes(engine.module, engine.basic_optimizer), grads=probe["grads"])
    return _Built(step, memory)


BUILDERS: dict[Trainer, Callable[[argparse.Namespace, dict, list], _Built]] = {
    Trainer.SHARDWISE: build_shardwise, Trainer.DDP: build_ddp, Trainer.DEEPSPEED: build_deepspeed}


# -- measurement --------------------------------------------------------------------------------------

def measure(trainers: dict[str, _Built], *, rounds: int, steps: int, warmup: int) -> dict[str, list[list[float]]]:
    """Step times [trainer][round][step] in seconds, each the slowest rank's."""
    names = list(trainers)
    for name in names:
        for _ in range(warmup):
            trainers[name].step()
    # times: [rounds, trainers, steps] on this rank; column = position in `names`
    times = torch.zeros(rounds, len(names), steps, dtype=torch.float64)
    for r in range(rounds):
        for name in rotation(names, r):
            dist.barrier()          # start each block together, so no rank's wait counts as the next step's
            j = names.index(name)
            for s in range(steps):
                t0 = time.perf_counter()
                trainers[name].step()
                times[r, j, s] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {name: times[:, j, :].tolist() for j, name in enumerate(names)}


def _rss_per_rank() -> list[int]:
    import resource
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.int64)
    gathered = [torch.zeros_like(rss) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, rss)
    return [int(t) for t in gathered]


def print_table(rows: Sequence[Row], *, title: str, rss: Sequence[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    def mib(n: int) -> str:
        return f"{n / MIB:.1f} MiB"

    table = Table(title=title)
    for col in ("trainer", "median step ms", "round medians ms", "tokens/s", "shardwise / this", "paired",
                "params", "grads", "optimizer", "model states"):
        table.add_column(col, justify="left" if col == "trainer" else "right")
    for r in rows:
        table.add_row(r.trainer, f"{r.median_ms:.2f}", f"{r.round_min_ms:.2f} - {r.round_max_ms:.2f}",
                      f"{r.tokens_per_s:,.0f}", f"{r.shardwise_ratio:.3f}",
                      f"{r.paired_ratio:.3f}", mib(r.params_bytes),
                      mib(r.grads_bytes), mib(r.optimizer_bytes), mib(r.model_states_bytes))
    console = Console() if sys.stdout.isatty() else Console(width=160)   # a log file: do not wrap at 80
    console.print(table)
    console.print("shardwise / this: ratio of median step times (< 1: shardwise faster); paired: median over rounds "
                  "of the same ratio within each round. Memory: each trainer's "
                  "model states on one rank (the trainers share a process, so RSS is not per trainer). "
                  f"Peak RSS per rank (whole process): {', '.join(mib(b) for b in rss)}")


def run(args: argparse.Namespace) -> list[Row]:
    """Build, time and report on the already initialized default group; rank 0 prints and writes JSON."""
    from shardwise.models import gpt_config, gpt_num_params
    preset, seq_len = gpt_config(args.model), args.seq_len
    config = ds_config(args)
    batches = _batches(args, seq_len, preset.vocab_size)
    wanted = [Trainer.SHARDWISE] + [t for t in Trainer if t is not Trainer.SHARDWISE and t.value in args.trainers]
    trainers = {t.value: BUILDERS[t](args, config, batches) for t in wanted}
    times = measure(trainers, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    memory = {name: built.memory() for name, built in trainers.items()}
    world = dist.get_world_size()
    rows = summarize(times, memory, tokens_per_step=args.micro_batch * seq_len * world)
    rss = _rss_per_rank()
    if dist.get_rank() == 0:
        title = (f"data parallel, {args.model} GPT ({gpt_num_params(preset):,} params), "
                 f"{world} ranks x micro-batch {args.micro_batch} x {seq_len} tokens, gloo, "
                 f"{torch.get_num_threads()} thread(s)/rank: median of {args.rounds} rounds x {args.steps} steps")
        print_table(rows, title=title, rss=rss)
        if args.json is not None:
            meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
            meta.update(world_size=world, seq_len=seq_len, threads_per_rank=torch.get_num_threads(),
                        ds_config=config)
            out = {"config": meta, "rows": [dict(asdict(r), model_states_bytes=r.model_states_bytes) for r in rows],
                   "peak_rss_bytes_per_rank": rss, "step_times_s": times}
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=2))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank under torch.distributed.run (it sets RANK, WORLD_SIZE, MASTER_ADDR)."""
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: python -m torch.distributed.run --nproc-per-node 2 "
              "-m shardwise.benchmarks.dp (or `shardwise bench dp --nproc 2`)", file=sys.stderr)
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "shardwise.benchmarks.dp", *argv]
    return subprocess.run(cmd, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode


if __name__ == "__main__":
    from shardwise.build import exit_rank
    exit_rank(main())
