"""The row layout's two copies on one transformer block (one process, no communication): the gather's copy out of
rank-major order, and the gradients' copy into it, each against the alternatives.

    OMP_NUM_THREADS=1 python -m benchmarks.row_copies --model small --world 2 --iters 200

Copy out, [W, S] rank-major -> the parameter-major buffer the parameters view: `RowLayout.copy_out` (one
`split_with_sizes_copy`), one `copy_` per parameter, `torch.cat` of the column blocks, and a plain memcpy of the
same bytes (the floor). Copy in, every parameter's full gradient -> the rank-major reduce-scatter input:
`RowLayout.add_grad` (strided adds straight into rank-major order) against contiguous adds into a parameter-major
buffer followed by one `torch.cat` into rank-major order. Median microseconds over `--iters` (after 10 untimed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Sequence

import torch

from benchmarks.common import int_at_least
from shardwise.models import GPT, gpt_config
from shardwise.parallel.zero.partition import RowLayout


def median_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(shapes: list[tuple[int, ...]], world: int, iters: int) -> dict[str, float]:
    layout = RowLayout.of_shapes(shapes, world)
    w, s, chunks = world, layout.shard_numel, list(layout.chunks)
    gathered = torch.randn(layout.padded_numel)
    full = torch.empty_like(gathered)
    blocks = [full[o:o + w * c].view(w, c) for o, c in zip(layout.offsets, layout.chunks)]

    def per_param() -> None:
        for dst, src in zip(blocks, gathered.view(w, s).split(chunks, dim=1)):
            dst.copy_(src)

    grads = [torch.randn(shape) for shape in shapes]
    rank_major = torch.zeros(layout.padded_numel)
    param_major = torch.zeros(layout.padded_numel)

    def add_direct() -> None:
        for i, g in enumerate(grads):
            layout.add_grad(rank_major, i, g)

    def add_then_cat() -> None:
        for o, g in zip(layout.offsets, grads):
            param_major[o:o + g.numel()].add_(g.reshape(-1))
        torch.cat([b.view(w, -1) for b in param_major.split([w * c for c in chunks])], dim=1, out=rank_major.view(w, s))

    return {
        "copy out: memcpy of the same bytes (floor)": median_us(lambda: full.copy_(gathered), iters),
        "copy out: RowLayout.copy_out (split_with_sizes_copy)": median_us(lambda: layout.copy_out(gathered, full),
                                                                           iters),
        "copy out: one copy_ per parameter": median_us(per_param, iters),
        "copy out: torch.cat of the column blocks": median_us(
            lambda: torch.cat([b.reshape(-1) for b in gathered.view(w, s).split(chunks, dim=1)], out=full), iters),
        "copy in: RowLayout.add_grad (into rank-major)": median_us(add_direct, iters),
        "copy in: contiguous adds, then torch.cat": median_us(add_then_cat, iters),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.row_copies", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="GPT preset whose first block is measured (default: small)")
    p.add_argument("--world", type=int_at_least(1), default=2, help="ranks the rows are split over (default: 2)")
    p.add_argument("--iters", type=int_at_least(1), default=200, help="timed repetitions (default: 200)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shapes = [tuple(q.shape) for q in GPT(gpt_config(args.model)).blocks[0].parameters()]
    numel = RowLayout.of_shapes(shapes, args.world).padded_numel
    print(f"GPT {args.model}, block 0: {len(shapes)} parameters, {numel:,} padded fp32 elements, {args.world} ranks")
    for name, us in measure(shapes, args.world, args.iters).items():
        print(f"  {name:55s} {us:9.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
