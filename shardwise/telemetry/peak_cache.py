"""The MFU denominator of a run: given, from a datasheet, or measured once per machine and cached.

A matmul measured at the start of every run moves with whatever else the machine is doing, so two
identical runs reported MFUs 30-46% apart. The measurement is therefore taken once per (device, dtype,
threads, torch version) and kept in a small JSON file (`PeakCache`); identical runs then divide by the same number.

    peak = resolve_peak(device=device, dtype=torch.bfloat16, given_tflops=args.peak_tflops)

The ranks of a job that measure do so at once, and each gets its own figure; they agree on one (`agree_measured`)
before any is cached or divided by, so the job's peak is the rank count times the figure printed and cached,
in the run that measured as in the runs that read it back.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from shardwise.telemetry.peak import measure_matmul_peak_flops

CACHE_ENV = "SHARDWISE_CACHE_DIR"
CACHE_FILE = "peak_flops.json"
_FORMAT = 1          # bump when the measurement changes, so old figures are not reused


class PeakOrigin(enum.StrEnum):
    GIVEN = "given"          # --peak-tflops
    SPEC = "spec"            # the datasheet of a known accelerator
    CACHED = "cached"        # measured by an earlier run on this machine
    MEASURED = "measured"    # measured now (and cached)


PeakSource = Callable[[torch.device, torch.dtype], tuple[float, str]]
"""Where the peak comes from: (device, dtype) -> (FLOP/s, origin). An answer of origin "spec" (a known
accelerator's datasheet) is used as is and never cached; "measured" is cached. `measured_peak` is the default."""


@dataclass(frozen=True)
class PeakFlops:
    """One rank's peak FLOP/s, where it came from and what it is for."""

    flops: float
    origin: PeakOrigin
    device_name: str
    dtype: torch.dtype
    cache_key: str = ""      # the entry it was read from or written to ("" when not cached)
    measured_by: int = 1     # ranks whose measurements it is the mean of (`agree_measured`)

    def describe(self) -> str:
        mean = f", the mean of {self.measured_by} ranks measuring at once" \
            if self.origin is PeakOrigin.MEASURED and self.measured_by > 1 else ""
        return f"{self.flops / 1e12:.4g} TFLOP/s per rank, {str(self.dtype).removeprefix('torch.')} on " \
               f"{self.device_name} ({self.origin.value}){mean}"


def agree_measured(peaks: list[PeakFlops]) -> list[PeakFlops]:
    """Every rank's peak (rank order), with the ranks that measured the same kind of device (one cache key) given
    the mean of their measurements: the figure their job divides by per rank, and the one cached for later runs.
    Without this, the job's peak would be the sum of N different figures while rank 0 prints and caches its own."""
    groups: dict[str, list[float]] = {}
    for peak in peaks:
        if peak.origin is PeakOrigin.MEASURED:
            groups.setdefault(peak.cache_key, []).append(peak.flops)
    return [dataclasses.replace(p, flops=sum(groups[p.cache_key]) / len(groups[p.cache_key]),
                                measured_by=len(groups[p.cache_key]))
            if p.origin is PeakOrigin.MEASURED else p for p in peaks]


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name, or the CPU model: what the peak belongs to."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def measured_peak(device: torch.device, dtype: torch.dtype, *, seconds: float = 0.5) -> tuple[float, str]:
    """Best of a @ b and a @ b.T in `dtype` with this process's threads (half the time each).

    Both layouts occur in a Linear layer's forward and backward; on CPU fp16 the plain one takes a
    generic kernel ten times slower than the transposed one, and the model's forward runs the fast one.
    An accelerator reaches its peak only on large tiles: 8192^2 there (1.1 TFLOP per call), 1024^2 on CPU.
    """
    size = 8192 if device.type == "cuda" else 1024
    best = max(measure_matmul_peak_flops(dtype=dtype, device=device, size=size, seconds=seconds / 2,
                                         transposed=t) for t in (False, True))
    return best, PeakOrigin.MEASURED.value


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardwise"


def cache_key(name: str, dtype: torch.dtype, device: torch.device) -> str:
    """Device name, dtype, threads (CPU) and torch version: what changes the measured figure."""
    threads = f"threads={torch.get_num_threads()}" if device.type == "cpu" else device.type
    return f"{name}|{str(dtype).removeprefix('torch.')}|{threads}|torch {torch.__version__}|v{_FORMAT}"


class PeakCache:
    """`{key: {"flops": float, "measured_at": "..."}}` in one JSON file, replaced atomically on write, under the
    user's cache directory (`$SHARDWISE_CACHE_DIR`, else `$XDG_CACHE_HOME/shardwise`, else `~/.cache/shardwise`).

    A file that cannot be read or parsed is treated as empty (it is a cache; the next write repairs it).
    Only a `writer` changes the file: the ranks of one node measure at once, and a rank that wrote first would
    make a slower rank read its figure back as "cached" in the same run.
    """

    def __init__(self, path: Path | None = None, *, writer: bool = True):
        self.path = path if path is not None else cache_dir() / CACHE_FILE
        self.writer = writer

    def _load(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> float | None:
        entry = self._load().get(key)
        flops = entry.get("flops") if isinstance(entry, dict) else None
        return float(flops) if isinstance(flops, (int, float)) and flops > 0 else None

    def _store(self, data: dict[str, dict]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A private temporary name per process: ranks of one node may write at once; last one wins.
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as e:       # a read-only home must not stop training: the run just re-measures
            print(f"shardwise: could not write the peak FLOP/s cache {self.path}: {e.strerror}", file=sys.stderr)

    def put(self, key: str, flops: float) -> None:
        if not self.writer:
            return
        data = self._load()
        data[key] = {"flops": flops, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self._store(data)

    def drop(self, key: str) -> None:
        if not self.writer:
            return
        data = self._load()
        if data.pop(key, None) is not None:
            self._store(data)


def resolve_peak(*, device: torch.device, dtype: torch.dtype, given_tflops: float | None = None,
                 source: PeakSource = measured_peak, cache: PeakCache | None = None) -> PeakFlops:
    """One rank's peak: `given_tflops`, else the cache, else `source` (cached when it measured, unless the cache
    is not a `writer`: a job's ranks cache the figure they agree on, `agree_measured`)."""
    name = device_name(device)
    if given_tflops is not None:
        return PeakFlops(given_tflops * 1e12, PeakOrigin.GIVEN, name, dtype)
    cache = cache if cache is not None else PeakCache()
    key = cache_key(name, dtype, device)
    cached = cache.get(key)
    if cached is not None:
        return PeakFlops(cached, PeakOrigin.CACHED, name, dtype, key)
    flops, origin = source(device, dtype)
    if origin != PeakOrigin.MEASURED:
        return PeakFlops(flops, PeakOrigin(origin), name, dtype)
    cache.put(key, flops)
    return PeakFlops(flops, PeakOrigin.MEASURED, name, dtype, key)


class PeakGuard:
    """Keeps MFU <= 100%: achieved FLOP/s above the job's peak mean the peak is wrong, not the run (measured
    while another job held the cores). It then says so in one line, raises the peak to the achieved rate (MFU
    reads 100%, never more) and drops the cache entry so the next run measures again."""

    def __init__(self, total_flops: float, rank_peak: PeakFlops, *, cache: PeakCache | None = None,
                 warn: Callable[[str], None] | None = None):
        self.total_flops = total_flops       # all ranks together
        self.rank_peak = rank_peak
        self.corrected = False
        self._cache = cache
        self._warn = warn if warn is not None else (lambda line: print(line, file=sys.stderr, flush=True))

    def bound(self, achieved_flops: float, step: int) -> float:
        """The peak to divide by at `step`: raised to `achieved_flops` (once said) when below it."""
        if achieved_flops <= self.total_flops:
            return self.total_flops
        if not self.corrected:
            what = "--peak-tflops" if self.rank_peak.origin is PeakOrigin.GIVEN else \
                f"the {self.rank_peak.origin.value} peak"
            dropped = self._cache is not None and bool(self.rank_peak.cache_key)
            self._warn(f"shardwise: step {step} ran at {achieved_flops / 1e12:.4g} TFLOP/s, above {what} of "
                       f"{self.total_flops / 1e12:.4g} TFLOP/s for the job: that peak is too low; MFU is "
                       f"reported against the achieved rate from here"
                       + ("; the cached figure is dropped, the next run measures again" if dropped else ""))
            if dropped:
                assert self._cache is not None
                self._cache.drop(self.rank_peak.cache_key)
        self.corrected = True
        self.total_flops = achieved_flops
        return self.total_flops
