"""Peaks of this process: the matmul FLOP/s the hardware delivers (the MFU denominator) and memory.

MFU (model FLOPs utilisation) is achieved model FLOP/s over the FLOP/s the hardware could deliver.
Accelerators publish the denominator; a CPU does not, and its real figure depends on the thread count,
the vector units and whoever else shares the cores. So on CPU we measure it: the best rate of a
square matmul with this process's threads, the same kernel that dominates a transformer step.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time

import torch

# One timed sample should last at least this long, so that timer resolution and (on CUDA) the
# synchronisation round trip stay a small fraction of what is measured.
_MIN_SAMPLE_S = 0.01
_WARMUP_CALLS = 3


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak_flops(*, dtype: torch.dtype = torch.float32, size: int = 1024,
                              seconds: float = 0.5, device: torch.device | str | None = None,
                              transposed: bool = False) -> float:
    """FLOP/s of a `size` x `size` matmul in `dtype` with the current thread count (or on the GPU).

    Warm-up calls first (thread-pool start-up, page faults on the output, clock ramp-up, cuBLAS
    heuristics), then timed samples for about `seconds`, and the BEST sample is returned. Why the best:
    on a shared machine noise only ever adds time (preemption, other processes, interrupts, cache
    pollution), so the fastest sample is the closest estimate of what the hardware can do; a mean
    would fold other tenants' load into the denominator and flatter the MFU.

    `device=None` uses CUDA when available, else the CPU. A square matmul costs 2 * size**3 FLOPs
    (one multiply and one add per term of each of the size**2 dot products). `transposed=True` times
    a @ b.T, the layout of nn.Linear's forward; some CPU kernels differ tenfold between the two (fp16).
    """
    if size < 1 or seconds <= 0:
        raise ValueError(f"size must be >= 1 and seconds > 0, got size={size}, seconds={seconds}")
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=dev, dtype=dtype)   # [size, size]
    b = torch.randn(size, size, generator=gen).to(device=dev, dtype=dtype)   # [size, size]
    rhs = b.t() if transposed else b                                          # [size, size], a view
    out = torch.empty(size, size, device=dev, dtype=dtype)
    flops_per_call = 2.0 * size ** 3

    def timed(calls: int) -> float:
        _synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, rhs, out=out)
        _synchronize(dev)
        return time.perf_counter() - t0

    timed(_WARMUP_CALLS)
    # Batch calls per sample so one sample lasts >= _MIN_SAMPLE_S (a 1024^2 matmul on a GPU is ~40 us).
    single = max(timed(1), 1e-9)
    calls = max(1, math.ceil(_MIN_SAMPLE_S / single))
    best = math.inf
    deadline = time.perf_counter() + seconds
    samples = 0
    while samples < 3 or time.perf_counter() < deadline:
        best = min(best, timed(calls) / calls)
        samples += 1
    return flops_per_call / best


def peak_rss_bytes() -> int:
    """Highest resident set size of this process so far, in bytes.

    `getrusage` reports `ru_maxrss` in KiB on Linux and in bytes on macOS.
    """
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def current_rss_bytes() -> int:
    """Resident set size of this process now, in bytes (Linux: /proc/self/statm, in pages).

    Where /proc is missing (macOS) this falls back to the peak, an upper bound of the current value.
    """
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])   # fields: size resident shared text lib data dt
    except OSError:
        return peak_rss_bytes()
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
