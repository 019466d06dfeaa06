"""What the run guards cost: the per-step desync check and the fp32 non-finite skip, on one GPT, same data.

    shardwise bench guards --nproc 2 [--model tiny --micro-batch 4 --rounds 20 --json out.json]

Every rank builds three engines from one seed (data parallel over the ranks, ZeRO 0, fp32, AdamW, clipping 1.0):
"off" (communication.desync_check false, nonfinite.skip_step false: no check, no overflow verdict), "desync"
(the check alone) and "all" (the defaults: the check and the fp32 skip). They take turns step by step in an order
that rotates every round, each step after a barrier; a step's time is the slowest rank's. Reported: the median
step time of each, its ratio to "off" (overall and paired per round), and the median time of the check itself
(`SequenceCheck.verify`: one all-reduce of 8 * (4 + 2 P) bytes over the world and its host read).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import (
    args_meta, int_at_least, rotation, run_in_gloo_group, run_under_launcher, write_json,
)

VARIANTS = {"off": {"communication": {"desync_check": False}, "nonfinite": {"skip_step": False}},
            "desync": {"communication": {"desync_check": True}, "nonfinite": {"skip_step": False}},
            "all": {}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise bench guards --nproc N",
                                description="Step time with and without the desync check and the fp32 skip.")
    p.add_argument("--model", default="tiny", help="GPT preset (default: %(default)s)")
    p.add_argument("--micro-batch", type=int_at_least(1), default=4, help="per rank (default: %(default)s)")
    p.add_argument("--rounds", type=int_at_least(1), default=20, help="timed steps of each (default: %(default)s)")
    p.add_argument("--warmup", type=int_at_least(1), default=3, help="untimed steps of each (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results to OUT")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    import shardwise
    from shardwise.models import GPT, gpt_config
    cfg = gpt_config(args.model)
    world, rank = dist.get_world_size(), dist.get_rank()
    engines = {}
    for name, blocks in VARIANTS.items():
        torch.manual_seed(1234)
        model = GPT(cfg)
        config = {"train_batch_size": args.micro_batch * world, "train_micro_batch_size_per_gpu": args.micro_batch,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, **blocks}
        engines[name], *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    checks: list[float] = []
    check = engines["desync"].sequence_check
    launch = check.launch      # the check's all-reduce, as each step opens (its result is read with the verdict)

    def timed_launch(step: int, kind: int = 0) -> None:
        t = time.perf_counter()
        launch(step, kind)
        checks.append(time.perf_counter() - t)
    check.launch = timed_launch
    g = torch.Generator().manual_seed(7 + rank)
    rows = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_len + 1), generator=g)
    batch = (rows[:, :-1], rows[:, 1:])

    def step(name: str) -> float:
        dist.barrier()
        t = time.perf_counter()
        engines[name].train_batch(iter([batch]))
        return time.perf_counter() - t

    for _ in range(args.warmup):
        for name in engines:
            step(name)
    checks.clear()
    names = list(engines)
    times = torch.zeros(args.rounds, len(names), dtype=torch.float64)        # [rounds, variants] seconds
    for i in range(args.rounds):
        for name in rotation(names, i):
            times[i, names.index(name)] = step(name)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    base = times[:, 0].tolist()
    out_rows = []
    for j, name in enumerate(names):
        mine = times[:, j].tolist()
        out_rows.append({"variant": name, "median_ms": statistics.median(mine) * 1e3,
                         "ratio_to_off": statistics.median(mine) / statistics.median(base),
                         "paired_ratio_to_off": statistics.median(a / b for a, b in zip(mine, base))})
    for e in engines.values():
        e.close()
    return {"config": args_meta(args) | {"ranks": world, "params": sum(p.numel() for p in engines["off"].parameters()),
                                         "seq": cfg.seq_len},
            "check_median_us": statistics.median(checks) * 1e6, "rows": out_rows}


def _print(result: dict[str, Any]) -> None:
    c = result["config"]
    print(f"GPT {c['model']} ({c['params']:,} params), {c['ranks']} ranks x micro-batch {c['micro_batch']} x "
          f"{c['seq']} tokens, fp32, median of {c['rounds']} rounds")
    print(f"{'variant':<8} {'step ms':>9} {'/ off':>7} {'paired':>7}")
    for r in result["rows"]:
        print(f"{r['variant']:<8} {r['median_ms']:>9.1f} {r['ratio_to_off']:>7.3f} {r['paired_ratio_to_off']:>7.3f}")
    print(f"desync check itself: median {result['check_median_us']:.0f} us per step")


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
