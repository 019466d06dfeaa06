"""All-reduce bus bandwidth: ours (`--ours ring`: `shardwise.comm.ring_all_reduce`; `--ours shm`: the
shared-memory all-reduce of `shardwise.comm.shm`, on a buffer every rank maps) against the backend's own
`dist.all_reduce`, side by side in one process group.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.allreduce \\
        --sizes-mb 1 4 16 64 256 --iters 20 --warmup 3 [--ours shm] --json allreduce.json

For each size the two implementations run alternately (ours first on even iterations, backend first on
odd ones) on the same freshly copied input, each start aligned by a barrier. An iteration's time is the
slowest rank's; the report gives the median over iterations, the algorithm bandwidth
algbw = bytes / time and the bus bandwidth busbw = algbw * 2(n-1)/n (the nccl-tests definition for
all-reduce: what each rank actually pushes through its link, comparable across world sizes), the ratio
of the two busbw medians and the median of the per-iteration ratios ("paired", robust to load drift).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import (
    int_at_least, positive_float, run_in_gloo_group, run_under_launcher, write_json,
)
from shardwise.comm.ring import DEFAULT_IN_FLIGHT, DEFAULT_SEGMENT_BYTES, ring_all_reduce

MIB = 1 << 20
OURS = ("ring", "shm")
DEFAULT_SIZES_MB = (1.0, 4.0, 16.0, 64.0, 256.0)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "int32": torch.int32, "int64": torch.int64}


class Impl(str, Enum):
    OURS = "ours"
    BACKEND = "backend"


def algorithm_bandwidth(nbytes: int, seconds: float) -> float:
    """algbw in bytes/s: the tensor size over the time one all-reduce takes."""
    return nbytes / seconds


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """busbw = algbw * 2(n-1)/n: the bytes each rank sends (and receives) per second in a
    bandwidth-optimal all-reduce, so it can be compared with the link speed and across n."""
    return algbw * 2 * (world_size - 1) / world_size


@dataclass(frozen=True)
class Row:
    """One tensor size. Times in ms, bandwidths in GB/s (1e9 bytes/s, as nccl-tests)."""

    size_mb: float            # MiB (2**20 bytes)
    nbytes: int
    ours_ms: float            # median over iterations of the slowest rank's time
    backend_ms: float
    ours_algbw_gbps: float
    ours_busbw_gbps: float
    backend_algbw_gbps: float
    backend_busbw_gbps: float
    ratio: float              # our busbw / backend busbw (> 1: ours is faster)
    paired_ratio: float       # median over iterations of backend time / our time in that iteration:
                              # steadier than `ratio` when the machine's load drifts during the run
    results_match: bool       # our result equals the backend's (fp tolerance)


def make_row(size_mb: float, nbytes: int, world_size: int, ours_s: Sequence[float],
             backend_s: Sequence[float], results_match: bool) -> Row:
    """Medians, bandwidths and the ratios from per-iteration times in seconds (index i of both lists:
    the same iteration)."""
    ours_t, backend_t = statistics.median(ours_s), statistics.median(backend_s)
    ours_alg, backend_alg = algorithm_bandwidth(nbytes, ours_t), algorithm_bandwidth(nbytes, backend_t)
    ours_bus, backend_bus = bus_bandwidth(ours_alg, world_size), bus_bandwidth(backend_alg, world_size)
    return Row(size_mb=size_mb, nbytes=nbytes, ours_ms=ours_t * 1e3, backend_ms=backend_t * 1e3,
               ours_algbw_gbps=ours_alg / 1e9, ours_busbw_gbps=ours_bus / 1e9,
               backend_algbw_gbps=backend_alg / 1e9, backend_busbw_gbps=backend_bus / 1e9,
               ratio=backend_t / ours_t,
               paired_ratio=statistics.median(b / r for r, b in zip(ours_s, backend_s)),
               results_match=results_match)


# -- arguments ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch.distributed.run --nproc-per-node N -m benchmarks.allreduce",
        description="Bus bandwidth of shardwise's ring or shared-memory all-reduce against the backend's "
                    "dist.all_reduce.")
    p.add_argument("--ours", choices=OURS, default="ring", help="which of ours: the ring, or shared memory "
                   "(ranks on one host) (default: %(default)s)")
    p.add_argument("--sizes-mb", type=positive_float("sizes"), nargs="+", default=list(DEFAULT_SIZES_MB),
                   metavar="MB", help="tensor sizes in MiB (default: %(default)s)")
    p.add_argument("--iters", type=int_at_least(1), default=20, help="timed iterations per "
                   "implementation and size (default: %(default)s)")
    p.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed iterations first "
                   "(default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="(default: %(default)s)")
    p.add_argument("--segment-kb", type=int_at_least(1), default=DEFAULT_SEGMENT_BYTES // 1024,
                   help="ring message size in KiB (default: %(default)s)")
    p.add_argument("--in-flight", type=int_at_least(1), default=DEFAULT_IN_FLIGHT,
                   help="ring receives posted ahead of the reduction (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the rows to OUT")
    return p


# -- measurement --------------------------------------------------------------------------------------

Ours = Callable[[int, torch.dtype], tuple[torch.Tensor, Callable[[torch.Tensor], None]]]
"""(numel, dtype) -> (the buffer to reduce, our all-reduce of it, in place)."""


def _ours(args: argparse.Namespace) -> Ours:
    if args.ours == "ring":
        fn = lambda t: ring_all_reduce(t, segment_bytes=args.segment_kb * 1024, in_flight=args.in_flight)  # noqa: E731
        return lambda numel, dtype: (torch.empty(numel, dtype=dtype), fn)

    def shared(numel: int, dtype: torch.dtype):
        # the buffer lives in shared memory (as the DDP wrapper's buckets do); the backend reduces it there too
        from shardwise.comm import Comm, CommLedger
        from shardwise.comm.shm import SharedBuffers
        buffers = SharedBuffers.create(Comm(None, CommLedger()), [(numel, dtype)])
        return buffers.local[0], lambda _t: buffers.all_reduce_(0)
    return shared


def _time_once(fn: Callable[[torch.Tensor], None], buf: torch.Tensor, src: torch.Tensor) -> float:
    buf.copy_(src)            # same input every time: repeated sums would otherwise overflow
    dist.barrier()            # align the start so the time is the collective's, not a straggler's
    t0 = time.perf_counter()
    fn(buf)
    return time.perf_counter() - t0


def measure(size_mb: float, dtype: torch.dtype, iters: int, warmup: int, ours: Ours) -> Row:
    """Time both implementations, interleaved, on a [size_mb MiB / element size] tensor."""
    world = dist.get_world_size()
    numel = max(1, int(size_mb * MIB) // torch.empty((), dtype=dtype).element_size())
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    src = (torch.rand(numel, generator=gen) * 2 - 1).to(dtype) if dtype.is_floating_point \
        else torch.randint(-100, 100, (numel,), generator=gen, dtype=dtype)
    buf, ours_fn = ours(src.numel(), src.dtype)
    impls = {Impl.OURS: ours_fn, Impl.BACKEND: lambda t: dist.all_reduce(t)}
    order = [Impl.OURS, Impl.BACKEND]
    for _ in range(warmup):
        for impl in order:
            _time_once(impls[impl], buf, src)
    # times: [iters, 2] seconds on this rank, column = Impl position in `order`
    times = torch.zeros(iters, len(order), dtype=torch.float64)
    for i in range(iters):
        for impl in (order if i % 2 == 0 else order[::-1]):
            times[i, order.index(impl)] = _time_once(impls[impl], buf, src)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)     # an all-reduce lasts as long as its slowest rank

    results = {}
    for impl in order:
        buf.copy_(src)
        impls[impl](buf)
        results[impl] = buf.clone()
    if dtype.is_floating_point:
        # both are sums of `world` values in [-1, 1] in some order: error <= (world - 1) * eps * world
        tol = (world - 1) * torch.finfo(dtype).eps * world
        match = torch.allclose(results[Impl.OURS], results[Impl.BACKEND], rtol=0.0, atol=2 * tol)
    else:
        match = torch.equal(results[Impl.OURS], results[Impl.BACKEND])
    nbytes = numel * src.element_size()
    return make_row(size_mb, nbytes, world, times[:, 0].tolist(), times[:, 1].tolist(), match)


def print_table(rows: Sequence[Row], *, world_size: int, backend: str, dtype: str, iters: int, ours: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"all-reduce, {world_size} ranks, {backend}, {dtype}: median of {iters} "
                        f"interleaved iterations; busbw = algbw * 2(n-1)/n")
    for name in ("size (MiB)", f"{ours} ms", f"{backend} ms", f"{ours} algbw GB/s", f"{ours} busbw GB/s",
                 f"{backend} busbw GB/s", f"{ours}/backend busbw", "paired", "results match"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(f"{r.size_mb:g}", f"{r.ours_ms:.3f}", f"{r.backend_ms:.3f}", f"{r.ours_algbw_gbps:.3f}",
                      f"{r.ours_busbw_gbps:.3f}", f"{r.backend_busbw_gbps:.3f}", f"{r.ratio:.2f}x",
                      f"{r.paired_ratio:.2f}x", "yes" if r.results_match else "NO")
    console = Console()
    if not console.is_terminal:     # piped into a file or a log: do not squeeze to 80 columns
        console = Console(width=160)
    console.print(table)


def run(args: argparse.Namespace) -> list[Row]:
    """Measure every size on the already initialized default group; rank 0 prints and writes JSON."""
    dtype = DTYPES[args.dtype]
    rows = [measure(mb, dtype, args.iters, args.warmup, _ours(args)) for mb in args.sizes_mb]
    if dist.get_rank() == 0:
        world, backend = dist.get_world_size(), str(dist.get_backend())
        print_table(rows, world_size=world, backend=backend, dtype=args.dtype, iters=args.iters, ours=args.ours)
        if args.json is not None:
            meta = {"world_size": world, "backend": backend, "dtype": args.dtype, "iters": args.iters, "ours": args.ours,
                    "warmup": args.warmup, "segment_kb": args.segment_kb, "in_flight": args.in_flight}
            write_json(args.json, {"config": meta, "rows": [asdict(r) for r in rows]})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank under torch.distributed.run (it sets RANK, WORLD_SIZE, MASTER_ADDR)."""
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run this module under the launcher: python -m torch.distributed.run "
              "--nproc-per-node 2 -m benchmarks.allreduce (or `shardwise bench allreduce "
              "--nproc 2`)", file=sys.stderr)
        return 2
    return run_in_gloo_group(run, args)     # one thread per rank, barrier before teardown


def launch(nproc: int, argv: Sequence[str] = ()) -> int:
    """Run this benchmark on `nproc` local ranks via torch's elastic launcher; returns its exit code.
    `argv` are this module's own options (e.g. ["--sizes-mb", "1", "4", "--json", "out.json"])."""
    if nproc < 2:
        raise ValueError(f"allreduce benchmark: --nproc must be >= 2 (an all-reduce over {nproc} rank moves "
                         f"no data); got {nproc}. Use --nproc 2 or more.")
    build_parser().parse_args(list(argv))        # reject bad options here, not on every rank
    return run_under_launcher("benchmarks.allreduce", nproc, argv)


if __name__ == "__main__":
    from shardwise.engine.initialize import exit_rank
    exit_rank(main())
