"""What checkpoint checksums cost: a save with the piece sums, and a load at another layout checking pieces against
checking whole files, with the bytes each rank reads to check.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.checkpoint_sums [--layers 5
        --width 256 --rounds 7 --json out.json]

A GPT (the tiny preset at --layers x --width: 5 x 256 is ~3.9M parameters, a tag of ~100 MiB) is written at ZeRO-1
over 2 data-parallel ranks (AdamW, fp32, one step), --rounds + 1 times (the first untimed). Reported: the median
save time (the slowest rank's) and the median time the slowest rank spends summing the pieces of its files
(`reshard.piece_sums`, inside the save). Then a copy of the tag whose index has the file sums alone (version 2, as
written before piece sums) is made, and engines at ZeRO-3 (every parameter partitioned: each rank needs half of
every tensor's optimizer state) load the two tags in turns: per tag, the median load time, the median time spent
checking (CRC-32 of pieces or of whole files), and the bytes each rank checked.
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
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import args_meta, int_at_least, rotation, write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch.distributed.run --nproc-per-node 2 -m benchmarks.checkpoint_sums",
                                description="Save and load cost of checkpoint checksums per piece and per file.")
    p.add_argument("--layers", type=int_at_least(1), default=5, help="GPT blocks (default: %(default)s)")
    p.add_argument("--width", type=int_at_least(8), default=256, help="d_model (default: %(default)s)")
    p.add_argument("--rounds", type=int_at_least(1), default=7, help="timed saves and loads (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    return p


class Stopwatch:
    """Adds up the time spent in the functions it wraps (module attributes, looked up at each call)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, module: Any, name: str) -> None:
        call: Callable[..., Any] = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        setattr(module, name, timed)

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _engine(args: argparse.Namespace, stage: int):
    import shardwise
    from shardwise.testing import tiny_gpt
    net = tiny_gpt(n_layer=args.layers, d_model=args.width, n_head=4, seq_len=16, seed=5)
    config = {"train_batch_size": 2 * dist.get_world_size(), "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = shardwise.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from shardwise.checkpoint import files as ckpt
    from shardwise.checkpoint import index as checkpoint_index
    from shardwise.checkpoint import reshard
    from shardwise.testing import micro_steps, token_batches

    summing, checking = Stopwatch(), Stopwatch()
    summing.wrap(reshard, "piece_sums")
    checking.wrap(ckpt, "tensor_crc")
    checking.wrap(ckpt, "verify_file")
    readers: list[Any] = []
    made = reshard.FileReader.__init__

    def recorded(self: Any, *a: Any, **k: Any) -> None:
        made(self, *a, **k)
        readers.append(self)
    reshard.FileReader.__init__ = recorded      # type: ignore[method-assign]

    writer = _engine(args, 1)
    rows = token_batches(1, 2 * dist.get_world_size(), 17, seed=0)
    for batch in micro_steps(rows, dp_size=writer.dp_size, dp_rank=writer.dp_rank, grad_accum=1):
        writer.train_batch(iter(batch))
    saves, sums = [], []
    for r in range(args.rounds + 1):
        summing.take()
        dist.barrier()
        start = time.perf_counter()
        writer.save_checkpoint(str(root), tag="pieces")
        dist.barrier()
        elapsed, summed = _slowest(time.perf_counter() - start), _slowest(summing.take())
        if r > 0:
            saves.append(elapsed)
            sums.append(summed)
    params = sum(p.numel() for p in writer.module.parameters())
    writer.close()
    index = checkpoint_index.read_index(root / "pieces")
    assert index is not None and index.pieces is not None
    if dist.get_rank() == 0:        # the same files, an index with the file sums alone (version 2)
        shutil.copytree(root / "pieces", root / "files")
        torch.save(checkpoint_index.sealed(index, index.checksums), root / "files" / checkpoint_index.INDEX)
    dist.barrier()
    loader = _engine(args, 3)
    tags = {"pieces (version 3)": "pieces", "whole files (version 2)": "files"}
    loads: dict[str, list[float]] = {name: [] for name in tags}
    checks: dict[str, list[float]] = {name: [] for name in tags}
    checked: dict[str, float] = {}
    for r in range(args.rounds + 1):
        for name in rotation(list(tags), r):
            readers.clear()
            checking.take()
            dist.barrier()
            start = time.perf_counter()
            loader.load_checkpoint(str(root), tag=tags[name])
            dist.barrier()
            elapsed, spent = _slowest(time.perf_counter() - start), _slowest(checking.take())
            if r > 0:
                loads[name].append(elapsed)
                checks[name].append(spent)
            checked[name] = _slowest(float(sum(reader.bytes_checked for reader in readers)))
    loader.close()
    reshard.FileReader.__init__ = made          # type: ignore[method-assign]
    return {"config": args_meta(args) | {"ranks": dist.get_world_size(), "params": params,
                                         "tag_mib": sum(s.size for s in index.checksums.values()) / 2**20},
            "save_median_ms": statistics.median(saves) * 1e3, "piece_sums_median_ms": statistics.median(sums) * 1e3,
            "loads": [{"check": name, "load_median_ms": statistics.median(loads[name]) * 1e3,
                       "check_median_ms": statistics.median(checks[name]) * 1e3,
                       "checked_mib_per_rank": checked[name] / 2**20} for name in tags]}


def _print(result: dict[str, Any]) -> None:
    c = result["config"]
    print(f"GPT {c['layers']} x {c['width']} ({c['params']:,} params), tag {c['tag_mib']:.1f} MiB written at ZeRO-1 "
          f"over {c['ranks']} ranks, medians of {c['rounds']}")
    print(f"save: {result['save_median_ms']:.0f} ms, of which summing the pieces "
          f"{result['piece_sums_median_ms']:.0f} ms (slowest rank)")
    print(f"{'load at ZeRO-3, checking':<26} {'load ms':>9} {'check ms':>9} {'MiB checked/rank':>17}")
    for row in result["loads"]:
        print(f"{row['check']:<26} {row['load_median_ms']:>9.0f} {row['check_median_ms']:>9.0f} "
              f"{row['checked_mib_per_rank']:>17.1f}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: python -m torch.distributed.run --nproc-per-node 2 "
              "-m benchmarks.checkpoint_sums", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    holder = [tempfile.mkdtemp(prefix="checkpoint-sums-bench-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    folder = holder[0]
    assert folder is not None
    result = run(args, Path(folder))
    if dist.get_rank() == 0:
        _print(result)
        if args.json is not None:
            write_json(args.json, result)
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
