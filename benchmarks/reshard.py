"""Loading a checkpoint at its own layout and at others: time and peak host memory per rank.

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m benchmarks.reshard [--model tiny|small
        --rounds 5 --json out.json]

One checkpoint is written at ZeRO-2 over 4 data-parallel ranks (AdamW, fp32, one step), and a copy of it
without its index (what shardwise wrote before indexes: read by the old same-layout path). Every rank then
builds one engine per reader, and the readers take turns loading, in an order that rotates every round, each
load between barriers; a load's time is the slowest rank's. Reported per reader: the median load time, its
ratio to the old path's, and the largest peak-RSS increase of a load on any rank (VmHWM reset before each load).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import args_meta, int_at_least, rotation, write_json

# name -> (layout of the loading engine, tag read)
READERS = {
    "same layout, no index (old path)": ({"zero": 2}, "legacy"),
    "same layout, indexed": ({"zero": 2}, "saved"),
    "ZeRO-3, dp 4": ({"zero": 3}, "saved"),
    "ZeRO-1, tp 2 x dp 2": ({"zero": 1, "tp": 2}, "saved"),
    "ZeRO-0, pp 2 x dp 2": ({"zero": 0, "pp": 2}, "saved"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch.distributed.run --nproc-per-node 4 -m benchmarks.reshard",
                                description="Checkpoint load time and memory at the writer's layout and others.")
    p.add_argument("--model", default="tiny", help="GPT preset (default: %(default)s)")
    p.add_argument("--rounds", type=int_at_least(1), default=5, help="timed loads of each (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    return p


def _engine(model_name: str, layout: dict):
    import shardwise
    from shardwise.models import GPT, gpt_config
    torch.manual_seed(0)
    model = GPT(gpt_config(model_name))
    config = {"train_batch_size": 4 * dist.get_world_size() // (layout.get("tp", 1) * layout.get("pp", 1)),
              "train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": layout["zero"]},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if layout.get("tp", 1) > 1:
        config["tensor_parallel"] = {"size": layout["tp"]}
    if layout.get("pp", 1) > 1:
        config["pipeline"] = {"stages": layout["pp"]}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmHWM:")).split()[1]) * 1024


def _reset_peak_rss() -> int:
    """Reset this process's peak RSS to its current RSS (Linux: /proc/self/clear_refs) and return it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak_rss()


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    writer = _engine(args.model, {"zero": 2})
    from shardwise.models import gpt_config
    cfg = gpt_config(args.model)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1),
                        generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(writer.gradient_accumulation_steps()):
        writer.backward(writer(ids[:, :-1], ids[:, 1:]))
        writer.step()
    writer.save_checkpoint(str(root), tag="saved")
    writer.close()
    if dist.get_rank() == 0:
        shutil.copytree(root / "saved", root / "legacy")
        (root / "legacy" / "shardwise_index.pt").unlink()
    dist.barrier()
    engines = {name: _engine(args.model, layout) for name, (layout, _) in READERS.items()}
    times: dict[str, list[float]] = {name: [] for name in READERS}
    grown: dict[str, list[float]] = {name: [] for name in READERS}
    for r in range(args.rounds + 1):                     # round 0 warms the page cache and the allocator
        for name in rotation(list(READERS), r):
            before = _reset_peak_rss()
            dist.barrier()
            start = time.perf_counter()
            engines[name].load_checkpoint(str(root), tag=READERS[name][1])
            dist.barrier()
            elapsed = _max_over_ranks(time.perf_counter() - start)
            peak = _max_over_ranks(float(_peak_rss() - before))
            if r > 0:
                times[name].append(elapsed)
                grown[name].append(peak)
    for e in engines.values():
        e.close()
    old = statistics.median(times["same layout, no index (old path)"])
    params = sum(p.numel() for p in _engine_params(args.model))
    return {"config": args_meta(args), "world": dist.get_world_size(), "params": params,
            "rows": [{"reader": name, "median_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3,
                      "max_ms": max(t) * 1e3, "ratio_to_old": statistics.median(t) / old,
                      "peak_rss_growth_mib": max(grown[name]) / 2**20} for name, t in times.items()]}


def _engine_params(model_name: str):
    from shardwise.models import GPT, gpt_config
    return GPT(gpt_config(model_name)).parameters()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: python -m torch.distributed.run --nproc-per-node 4 "
              "-m benchmarks.reshard", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        print("error: benchmarks.reshard needs --nproc-per-node 4", file=sys.stderr)
        return 2
    holder = [tempfile.mkdtemp(prefix="reshard-bench-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    result = run(args, Path(holder[0]))
    if dist.get_rank() == 0:
        print(f"{args.model} GPT ({result['params']:,} params), {args.rounds} rounds, 4 gloo ranks; written at "
              f"ZeRO-2 dp 4")
        print(f"{'reader':<34} {'median ms':>10} {'min-max ms':>16} {'/ old':>7} {'peak RSS +MiB':>14}")
        for row in result["rows"]:
            print(f"{row['reader']:<34} {row['median_ms']:>10.1f} {row['min_ms']:>7.1f}-{row['max_ms']:<8.1f} "
                  f"{row['ratio_to_old']:>7.2f} {row['peak_rss_growth_mib']:>14.1f}")
        if args.json is not None:
            write_json(args.json, result)
        shutil.rmtree(holder[0], ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
