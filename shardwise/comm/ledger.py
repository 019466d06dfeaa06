"""Per-rank record of every collective: the source of `engine.comm_report()`, of the planner's
validation and of hang diagnostics.

A ledger is an ordinary object owned by the engine (no module global). Each `Comm` handle writes one
`CommRecord` per operation it launches; the engine opens a new step with `begin_step()`.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class CommRecord:
    op: str            # "all_reduce", "ring_all_reduce", "broadcast", "all_gather", "reduce_scatter", "send", ...
    group: str         # a readable name of the group ("dp", "world", ...)
    group_size: int
    nbytes: int        # payload bytes of the tensor this rank contributes (numel * element size)
    dtype: str
    duration_s: float  # launch to completion, as seen by this rank (includes waiting for peers)
    step: int


@dataclass
class OpSummary:
    op: str
    group: str
    group_size: int
    dtype: str
    count: int = 0
    nbytes: int = 0
    duration_s: float = 0.0


@dataclass
class CommLedger:
    """Thread-safe: gradient buckets complete on a communication thread while backward runs."""

    step: int = 0
    records: list[CommRecord] = field(default_factory=list)
    in_flight: dict[int, tuple[str, str, float]] = field(default_factory=dict)
    keep_steps: int = 2
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _next_id: int = 0
    listeners: list[Callable[[CommRecord], None]] = field(default_factory=list)
    """Called with every record as it is made (the comms logger); on whichever thread completed the op."""

    def begin_step(self, step: int) -> None:
        """Start recording for `step`; keep only the last `keep_steps` steps so memory stays bounded."""
        with self._lock:
            self.step = step
            self.records = [r for r in self.records if r.step > step - self.keep_steps]

    def start(self, op: str, group: str) -> int:
        """Mark an operation as launched (read by hang diagnostics); returns a token for `finish`."""
        with self._lock:
            token = self._next_id
            self._next_id += 1
            self.in_flight[token] = (op, group, time.perf_counter())
            return token

    def finish(self, token: int, *, op: str, group: str, group_size: int, nbytes: int, dtype: str) -> None:
        with self._lock:
            _, _, t0 = self.in_flight.pop(token, (op, group, time.perf_counter()))
            record = CommRecord(op, group, group_size, nbytes, dtype, time.perf_counter() - t0, self.step)
            self.records.append(record)
        for listener in self.listeners:
            listener(record)

    def pending(self) -> list[tuple[str, str, float]]:
        """Operations launched and not finished: (op, group, seconds waiting)."""
        now = time.perf_counter()
        with self._lock:
            return [(op, g, now - t0) for op, g, t0 in self.in_flight.values()]

    def summary(self, step: int | None = None) -> list[OpSummary]:
        """Collectives of one step (the current one by default), grouped by (op, group, dtype)."""
        step = self.step if step is None else step
        out: dict[tuple[str, str, int, str], OpSummary] = {}
        with self._lock:
            records = [r for r in self.records if r.step == step]
        for r in records:
            key = (r.op, r.group, r.group_size, r.dtype)
            s = out.setdefault(key, OpSummary(r.op, r.group, r.group_size, r.dtype))
            s.count += 1
            s.nbytes += r.nbytes
            s.duration_s += r.duration_s
        return list(out.values())

    def bytes_by_op(self, step: int | None = None) -> dict[str, int]:
        totals: dict[str, int] = defaultdict(int)
        for s in self.summary(step):
            totals[s.op] += s.nbytes
        return dict(totals)
