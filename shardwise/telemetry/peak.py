"""Peaks of this process: the matmul FLOP/s the hardware delivers (the MFU denominator) and memory.

MFU (model FLOPs utilisation) is achieved model FLOP/s over the FLOP/s the hardware could deliver.
Accelerators publish the denominator (`SPEC_PEAK_TFLOPS_BF16`, used for known GPUs); a CPU does not, and its real figure depends on the thread count,
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


# Dense (no sparsity) bf16/fp16 tensor-core peaks from the vendors' datasheets, TFLOP/s: the MFU denominator the
# papers use. Matched against torch.cuda.get_device_name in order: the first key contained in the name wins, so
# the more specific names come first (an "H100 PCIe" is not an SXM part).
SPEC_PEAK_TFLOPS_BF16: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),          # SXM / HBM3
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
)
_LARGE_MATMUL = 8192          # an accelerator reaches its matmul peak only on large tiles


def spec_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The datasheet dense peak FLOP/s of a known GPU for bf16/fp16 matmuls; None for an unknown GPU or another
    dtype (fp32 runs on other units at other rates: it is measured)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    name = device_name.upper()
    for key, tflops in SPEC_PEAK_TFLOPS_BF16:
        if key in name:
            return tflops * 1e12
    return None


def device_peak_flops(device: torch.device | str, dtype: torch.dtype, *, seconds: float = 0.5) -> tuple[float, str]:
    """The MFU denominator for `device` and the training dtype, with where it came from: the datasheet peak of a
    known GPU ("spec"), else a matmul measured now ("measured": 8192^2 on a GPU, 1024^2 on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        spec = spec_peak_flops(torch.cuda.get_device_name(device), dtype)
        if spec is not None:
            return spec, "spec"
        return measure_matmul_peak_flops(dtype=dtype, size=_LARGE_MATMUL, seconds=seconds, device=device), "measured"
    return measure_matmul_peak_flops(dtype=dtype, seconds=seconds, device=device), "measured"


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
