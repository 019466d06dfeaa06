"""What the run guards cost per step: the desync check, the stop vote and the fp32 non-finite skip, on one GPT.

    shardwise bench guards --nproc 2 [--model tiny --micro-batch 4 --rounds 20 --json out.json]

The desync check and the stop vote run on the host, on the guards' own gloo group (`ParallelMesh.guard_comm`):
one all-reduce MAX of int64 [5 + 4P] per step, launched asynchronously as the step opens (`SequenceCheck.launch`)
and judged before the step's next collective on another group, or before the update (`settle`); the stop vote
`shardwise train` asks after every step (`agree_stop`) rides in it. With the check off the stop vote is a
one-value all-reduce of its own. The fp32 skip is a flag summed in the step's gradient-norm all-reduce.

Every rank builds four engines from one seed (data parallel over the ranks, ZeRO 0, fp32, AdamW, clipping 1.0),
and calls `agree_stop` after each step as `shardwise train` does, except in "none":
    none     no desync check, no fp32 skip, no stop vote (a loop without guards)
    stop     the stop vote alone (its own all-reduce per step)
    desync   the desync check carrying the stop vote, no fp32 skip
    all      the defaults: the check with the stop vote, and the fp32 skip
They take turns step by step in an order that rotates every round, each step after a barrier; a step's time is
the slowest rank's. Reported: each variant's median step time, its ratio to "none" (of the medians, and the
median of the per-round ratios), and the median host time per step spent in the guards' own calls (`launch`,
`settle`, `agree_stop`: starting the check, waiting for and judging its result, the vote), the slowest rank's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import (
    args_meta, int_at_least, rotation, run_in_gloo_group, run_under_launcher, write_json,
)

OFF = {"communication": {"desync_check": False}, "nonfinite": {"skip_step": False}}
VARIANTS = {"none": OFF, "stop": OFF,
            "desync": {"communication": {"desync_check": True}, "nonfinite": {"skip_step": False}},
            "all": {}}
VOTES = frozenset({"stop", "desync", "all"})
"""The variants that ask the stop vote after each step."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise bench guards --nproc N",
                                description="Step time and host time per step of the desync check, the stop vote "
                                            "and the fp32 skip, against a loop without them.")
    p.add_argument("--model", default="tiny", help="GPT preset (default: %(default)s)")
    p.add_argument("--micro-batch", type=int_at_least(1), default=4, help="per rank (default: %(default)s)")
    p.add_argument("--rounds", type=int_at_least(1), default=20, help="timed steps of each (default: %(default)s)")
    p.add_argument("--warmup", type=int_at_least(1), default=3, help="untimed steps of each (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results to OUT")
    return p


class GuardClock:
    """Adds up the host time a `SequenceCheck` spends in `launch`, `settle` and `agree_stop` (outermost calls only:
    `launch` and `agree_stop` settle first), by wrapping them on the instance, which its callers look up."""

    def __init__(self, check: Any):
        self.seconds = 0.0
        self._depth = 0
        for name in ("launch", "settle", "agree_stop"):
            setattr(check, name, self._timed(getattr(check, name)))

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            t = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - t
        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    import shardwise
    from shardwise.models import GPT, gpt_config
    cfg = gpt_config(args.model)
    world, rank = dist.get_world_size(), dist.get_rank()
    engines, clocks = {}, {}
    for name, blocks in VARIANTS.items():
        torch.manual_seed(1234)
        model = GPT(cfg)
        config = {"train_batch_size": args.micro_batch * world, "train_micro_batch_size_per_gpu": args.micro_batch,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, **blocks}
        engines[name], *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
        clocks[name] = GuardClock(engines[name].sequence_check)
    g = torch.Generator().manual_seed(7 + rank)
    rows = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_len + 1), generator=g)
    batch = (rows[:, :-1], rows[:, 1:])

    def step(name: str) -> tuple[float, float]:
        """(step seconds, guard seconds) of one step of `name`, its stop vote included."""
        engine = engines[name]
        dist.barrier()
        t = time.perf_counter()
        engine.train_batch(iter([batch]))
        if name in VOTES:
            engine.sequence_check.agree_stop(0)
        return time.perf_counter() - t, clocks[name].take()

    for _ in range(args.warmup):
        for name in engines:
            step(name)
    names = list(engines)
    times = torch.zeros(2, args.rounds, len(names), dtype=torch.float64)     # [step | guards, rounds, variants] s
    for i in range(args.rounds):
        for name in rotation(names, i):
            times[:, i, names.index(name)] = torch.tensor(step(name), dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    base = times[0, :, 0].tolist()
    out_rows = []
    for j, name in enumerate(names):
        mine = times[0, :, j].tolist()
        out_rows.append({"variant": name, "median_ms": statistics.median(mine) * 1e3,
                         "ratio_to_none": statistics.median(mine) / statistics.median(base),
                         "paired_ratio_to_none": statistics.median(a / b for a, b in zip(mine, base)),
                         "guards_median_us": statistics.median(times[1, :, j].tolist()) * 1e6})
    params = sum(p.numel() for p in engines["none"].parameters())
    for e in engines.values():
        e.close()
    return {"config": args_meta(args) | {"ranks": world, "params": params, "seq": cfg.seq_len}, "rows": out_rows}


def _print(result: dict[str, Any]) -> None:
    c = result["config"]
    print(f"GPT {c['model']} ({c['params']:,} params), {c['ranks']} ranks x micro-batch {c['micro_batch']} x "
          f"{c['seq']} tokens, fp32, median of {c['rounds']} rounds")
    print(f"{'variant':<8} {'step ms':>9} {'/ none':>7} {'paired':>7} {'guards us/step':>15}")
    for r in result["rows"]:
        print(f"{r['variant']:<8} {r['median_ms']:>9.1f} {r['ratio_to_none']:>7.3f} "
              f"{r['paired_ratio_to_none']:>7.3f} {r['guards_median_us']:>15.0f}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: shardwise bench guards --nproc 2", file=sys.stderr)
        return 2

    def run_and_report(args: argparse.Namespace) -> None:
        result = run(args)
        if dist.get_rank() == 0:
            _print(result)
            if args.json is not None:
                write_json(args.json, result)

    return run_in_gloo_group(run_and_report, args)     # one thread per rank, barrier before teardown


def launch(nproc: int, argv: Sequence[str] = ()) -> int:
    """Run on `nproc` local ranks through torch's elastic launcher; returns its exit code."""
    build_parser().parse_args(list(argv))
    return run_under_launcher("benchmarks.guards", nproc, argv)


if __name__ == "__main__":
    from shardwise.engine.initialize import exit_rank
    exit_rank(main())
