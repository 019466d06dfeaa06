"""Activation recomputation: what each policy stores and what it costs, on one GPT, same data, same ranks.

    shardwise bench recompute --nproc 2 [--model tiny|small --seq 256 --micro-batch 8 --rounds 8 --json out.json]

Every rank builds one engine per policy (none, selective, full, every_n with every 2) from one seed, data
parallel over the ranks (ZeRO 0, fp32, AdamW, no clipping). The engines take turns step by step, in an order that
rotates every round, each step after a barrier; a step's time is the slowest rank's. Reported per policy:
`memory_report()["activations"]` per rank (what the forward saved for backward), the planner's prediction of the
same bytes, the peak device memory of a step on CUDA (`torch.cuda.max_memory_allocated`; on the CPU there is no
per-policy allocator peak to read), the median step time, its ratio to "none" (overall and paired per round), and
the first step's loss (equal for every policy: recomputation is exact).
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
    args_meta, int_at_least, rotation, run_in_gloo_group, run_under_launcher, sequence_length, write_json,
)

POLICIES = {"none": {"policy": "none"}, "selective": {"policy": "selective"}, "full": {"policy": "full"},
            "every_2": {"policy": "every_n", "every": 2}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise bench recompute --nproc N",
                                description="Activation recomputation policies: stored bytes and step time.")
    p.add_argument("--model", default="tiny", help="GPT preset (default: %(default)s)")
    p.add_argument("--seq", type=int_at_least(1), default=None, help="sequence length (default: the preset's)")
    p.add_argument("--micro-batch", type=int_at_least(1), default=8, help="per rank (default: %(default)s)")
    p.add_argument("--rounds", type=int_at_least(1), default=8, help="timed steps of each (default: %(default)s)")
    p.add_argument("--warmup", type=int_at_least(1), default=2, help="untimed steps of each (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results to OUT")
    return p


def _predicted(cfg: Any, seq: int, micro: int, policy: str) -> float:
    """The planner's bytes for what forward saves (SDPA attention: no stored scores; without the one layer that
    full recomputation rebuilds during backward)."""
    from shardwise.planner import JobSpec, Plan, Precision, Recompute, activation_bytes
    recompute = {"none": Recompute.NONE, "selective": Recompute.SELECTIVE, "full": Recompute.FULL}.get(policy)
    if recompute is None:
        return float("nan")            # every_n: between none and full; the planner has no such plan
    act = activation_bytes(cfg, JobSpec(global_batch=micro, seq_len=seq, precision=Precision.FP32,
                                        flash_attention=True),
                           Plan(micro_batch=micro, recompute=recompute))
    return act.total - act.recompute_working


def run(args: argparse.Namespace, seq: int) -> dict[str, Any]:
    import shardwise
    from shardwise.models import GPT, gpt_config
    cfg = gpt_config(args.model, seq_len=seq)
    world, rank = dist.get_world_size(), dist.get_rank()
    engines = {}
    for name, block in POLICIES.items():
        torch.manual_seed(1234)
        model = GPT(cfg)
        config = {"train_batch_size": args.micro_batch * world, "train_micro_batch_size_per_gpu": args.micro_batch,
                  "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                  "activation_checkpointing": block}
        engines[name], *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(7 + rank)
    rows = torch.randint(0, cfg.vocab_size, (args.micro_batch, seq + 1), generator=g)
    batch = (rows[:, :-1], rows[:, 1:])
    cuda = torch.cuda.is_available()

    def step(name: str) -> tuple[float, float, int | None]:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        loss = float(engines[name].train_batch(iter([batch])))
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, loss, torch.cuda.max_memory_allocated() if cuda else None

    first = {name: step(name)[1] for name in engines}
    peaks: dict[str, int | None] = {}
    for _ in range(args.warmup - 1):
        for name in engines:
            peaks[name] = step(name)[2]
    names = list(engines)
    times = torch.zeros(args.rounds, len(names), dtype=torch.float64)        # [rounds, policies] seconds
    for i in range(args.rounds):
        for name in rotation(names, i):
            times[i, names.index(name)] = step(name)[0]
    dist.all_reduce(times, op=dist.ReduceOp.MAX)                            # a step lasts as long as its slowest rank
    base = times[:, 0].tolist()
    rows_out = []
    for j, name in enumerate(names):
        mine = times[:, j].tolist()
        rows_out.append({"policy": name, "activations": engines[name].memory_report()["activations"],
                         "predicted": _predicted(cfg, seq, args.micro_batch, name), "cuda_peak": peaks.get(name),
                         "median_ms": statistics.median(mine) * 1e3,
                         "ratio_to_none": statistics.median(mine) / statistics.median(base),
                         "paired_ratio_to_none": statistics.median(a / b for a, b in zip(mine, base)),
                         "first_loss": first[name]})
    for e in engines.values():
        e.close()
    return {"config": args_meta(args) | {"seq": seq, "ranks": world, "params": sum(p.numel() for p in
                                                                                   engines["none"].parameters())},
            "rows": rows_out}


def _print(result: dict[str, Any]) -> None:
    c = result["config"]
    print(f"GPT {c['model']} ({c['params']:,} params), {c['ranks']} ranks x micro-batch {c['micro_batch']} x "
          f"{c['seq']} tokens, fp32, median of {c['rounds']} rounds")
    print(f"{'policy':<10} {'activations MiB':>16} {'planner MiB':>12} {'step ms':>9} {'/ none':>7} {'paired':>7}  "
          f"first loss")
    for r in result["rows"]:
        print(f"{r['policy']:<10} {r['activations'] / 2**20:>16.2f} {r['predicted'] / 2**20:>12.2f} "
              f"{r['median_ms']:>9.1f} {r['ratio_to_none']:>7.3f} {r['paired_ratio_to_none']:>7.3f}  "
              f"{r['first_loss']:.6f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: shardwise bench recompute --nproc 2", file=sys.stderr)
        return 2
    from shardwise.models import gpt_config
    seq = sequence_length(parser, args.seq, gpt_config(args.model).seq_len, flag="--seq", model=args.model)

    def run_and_report(args: argparse.Namespace) -> None:
        result = run(args, seq)
        if dist.get_rank() == 0:
            _print(result)
            if args.json is not None:
                write_json(args.json, result)

    return run_in_gloo_group(run_and_report, args)     # one thread per rank, barrier before teardown


def launch(nproc: int, argv: Sequence[str] = ()) -> int:
    """Run on `nproc` local ranks through torch's elastic launcher; returns its exit code. Bad options are
    refused here, before any rank starts."""
    args = build_parser().parse_args(list(argv))
    from shardwise.models import gpt_config
    limit = gpt_config(args.model).seq_len
    if args.seq is not None and args.seq > limit:
        raise ValueError(f"--seq {args.seq} exceeds the {args.model} model's seq_len {limit} (its learned position "
                         f"table): use --seq {limit} or less")
    return run_under_launcher("benchmarks.recompute", nproc, argv)


if __name__ == "__main__":
    from shardwise.engine.initialize import exit_rank
    exit_rank(main())
