"""What the benchmark modules share: argparse types (errors exit 2 with argparse's one line) and the
launcher command that starts a module on local ranks."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value
    return parse


def positive_float(what: str = "") -> Callable[[str], float]:
    """`what` names the quantity in the error, e.g. "sizes ... MiB"."""
    def parse(text: str) -> float:
        value = float(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{what + ' ' if what else ''}must be > 0, got {text}")
        return value
    return parse


def add_side_by_side_args(p: argparse.ArgumentParser, *, warmup: int, compared: str) -> None:
    """The arguments of a benchmark that alternates two trainers on the same work: --rounds, --steps, --warmup,
    --rtol and --json. `compared`: what the warm-up compares between them, e.g. "losses"."""
    p.add_argument("--rounds", type=int_at_least(1), default=10, help="rounds of (steps x each trainer), "
                   "alternating which goes first (default: %(default)s)")
    p.add_argument("--steps", type=int_at_least(1), default=3, help="timed steps per trainer per round "
                   "(default: %(default)s)")
    p.add_argument("--warmup", type=int_at_least(1), default=warmup, help=f"untimed steps of each first, their "
                   f"{compared} compared (default: %(default)s)")
    p.add_argument("--rtol", type=positive_float(), default=1e-5, help="largest relative difference allowed "
                   f"between the warm-up {compared.split(' (')[0]} (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results to OUT")


def sequence_length(parser: argparse.ArgumentParser, value: int | None, limit: int, *, flag: str, model: str) -> int:
    """``value`` (default: ``limit``), refused through ``parser`` (exit 2) past the model's learned position table."""
    if value is None:
        return limit
    if value > limit:
        parser.error(f"{flag} {value} exceeds the {model} model's seq_len {limit} (its learned position table): use "
                     f"{flag} {limit} or less")
    return value


def args_meta(args: argparse.Namespace) -> dict[str, Any]:
    """A benchmark's options as JSON values (paths as strings): the "config" of its report."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write a report atomically (a killed run never leaves a half-written file); values JSON cannot hold are
    written as strings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)


def run_under_launcher(module: str, nproc: int, argv: Sequence[str], *, threads_per_rank: int | None = None) -> int:
    """Start `python -m module *argv` on `nproc` local ranks through torch's elastic launcher (standalone
    rendezvous); returns its exit code. `threads_per_rank` sets OMP_NUM_THREADS for the ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", module, *argv]
    env = {**os.environ, "PYTHONPATH": _with_checkout(os.environ.get("PYTHONPATH", ""))}
    if threads_per_rank is not None:
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
    elif nproc > 1:
        # torchrun would set the same 1 thread per rank itself, after printing a starred banner saying so.
        env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(cmd, check=False, env=env).returncode


def _with_checkout(pythonpath: str) -> str:
    """`pythonpath` with the repository root first: the ranks import `benchmarks.<name>` from this checkout
    whatever their working directory (the package is not installed)."""
    root = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join([root, *(p for p in pythonpath.split(os.pathsep) if p and p != root)])


def run_in_gloo_group(run: Callable[[Any], None], args: Any) -> int:
    """Inside a launched rank: one torch thread (the ranks share the machine's cores), a gloo group, `run(args)`,
    then a barrier so no rank tears the group down while a peer still uses it. Returns the exit code 0."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        run(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


@dataclass(frozen=True)
class Timing:
    """One trainer's step times against the reference trainer's (seconds)."""

    median_s: float               # median over every timed step
    round_min_s: float            # smallest and largest per-round median: the run-to-run spread
    round_max_s: float
    ratio: float                  # reference median / this median (< 1: the reference is faster)
    paired_ratio: float           # median over rounds of reference round median / this round median: robust to
                                  # load drifting between rounds, as each round's trainers ran back to back


@dataclass(frozen=True)
class TimedRow:
    """The timing columns of a side-by-side table row: one trainer's figures against shardwise's, in ms."""

    trainer: str
    median_ms: float              # median over every timed step (slowest rank's time)
    round_min_ms: float           # smallest and largest per-round median: the run-to-run spread
    round_max_ms: float
    tokens_per_s: float           # the benchmark's tokens per step (global, or one TP group's) at the median time
    shardwise_ratio: float        # shardwise median / this median (< 1: shardwise is faster)
    paired_ratio: float           # median over rounds of (shardwise round median / this round median): robust to
                                  # load that drifts between rounds, as each round's trainers ran back to back

    @staticmethod
    def timing_fields(trainer: str, t: Timing, tokens_per_step: int) -> dict[str, Any]:
        """The columns above from a `compare_times` entry (shardwise the reference)."""
        return dict(trainer=trainer, median_ms=t.median_s * 1e3, round_min_ms=t.round_min_s * 1e3,
                    round_max_ms=t.round_max_s * 1e3, tokens_per_s=tokens_per_step / t.median_s,
                    shardwise_ratio=t.ratio, paired_ratio=t.paired_ratio)


def compare_times(times_s: dict[str, list[list[float]]], reference: str) -> dict[str, Timing]:
    """`times_s[trainer][round][step]` in seconds -> each trainer's `Timing` against `reference`'s."""
    medians = {name: statistics.median(t for rnd in rounds for t in rnd) for name, rounds in times_s.items()}
    ours_per_round = [statistics.median(rnd) for rnd in times_s[reference]]
    out = {}
    for name, rounds in times_s.items():
        per_round = [statistics.median(rnd) for rnd in rounds]
        out[name] = Timing(medians[name], min(per_round), max(per_round), medians[reference] / medians[name],
                           statistics.median(a / b for a, b in zip(ours_per_round, per_round)))
    return out


def rotation(trainers: Sequence[Any], round_index: int) -> list[Any]:
    """Round r runs the trainers rotated left by r: ABC, BCA, CAB, ABC, ..."""
    k = round_index % len(trainers)
    return list(trainers[k:]) + list(trainers[:k])


def rss_per_rank() -> list[int]:
    """Every rank's peak resident set size in bytes (collective: an all-gather over the default group)."""
    import resource

    import torch
    import torch.distributed as dist
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.int64)
    gathered = [torch.zeros_like(rss) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, rss)
    return [int(t) for t in gathered]
