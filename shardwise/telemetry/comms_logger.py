"""DeepSpeed's "comms_logger": a per-op summary of the collectives, printed on global rank 0.

It listens to the communication ledger, so it sees every collective the strategies issue (they all go
through a `Comm`). Bandwidths follow the NCCL-tests convention, in Gbit/s: algbw = bytes / time,
busbw = algbw * `bus_factor(op, n)`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, TextIO

from shardwise.comm.ledger import CommLedger, CommRecord
from shardwise.config.monitoring import CommsLoggerConfig


def bus_factor(op: str, group_size: int) -> float:
    """How many times its payload an op moves through each rank's link (NCCL-tests' bus bandwidth factor):
    2(n-1)/n for an all-reduce, (n-1)/n for an all-gather or reduce-scatter and 1 otherwise, n being the group's
    size. The ledger's bytes are the whole payload of the op (all-reduce: the tensor; all-gather: the gathered
    output; reduce-scatter: the full input)."""
    n = group_size
    if op in ("all_reduce", "ring_all_reduce", "shm_all_reduce"):
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0


def format_size(nbytes: int) -> str:
    """1536 -> '1.5 KB' (binary multiples, as DeepSpeed's comms summary shows them)."""
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@dataclass
class CommRow:
    """One (op, [group,] message size) line of the summary. Its time is launch to completion as this rank saw it:
    an overlapped op's time includes the compute it overlapped and any wait for slower peers."""

    op: str
    group: str | None
    group_size: int
    msg_bytes: int
    count: int = 0
    seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        return self.msg_bytes * self.count

    @property
    def algbw_gbps(self) -> float:
        return gbps(self.total_bytes, self.seconds)

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * bus_factor(self.op, self.group_size)


class CommsLogger:
    """Accumulates ledger records into `rows` (on every rank, so any rank can ask); prints on rank 0 only.
    Rows are keyed by (op, message size), or (op, group, message size) with "debug", and accumulate until the
    summary is printed (every `steps_per_print` steps), then start over."""

    def __init__(self, section: CommsLoggerConfig, ledger: CommLedger, *, global_rank: int,
                 out: Callable[[str], None]):
        self.section = section
        self.global_rank = global_rank
        self._out = out
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, str | None, int, int], CommRow] = {}
        self._ledger = ledger
        ledger.listeners.append(self._record)

    def _record(self, record: CommRecord) -> None:
        if not self.section.logs(record.op):
            return
        group = record.group if self.section.debug else None
        key = (record.op, group, record.group_size, record.nbytes)
        with self._lock:
            row = self._rows.setdefault(key, CommRow(record.op, group, record.group_size, record.nbytes))
            row.count += 1
            row.seconds += record.duration_s
        if self.section.verbose and self.global_rank == 0:
            algbw = gbps(record.nbytes, record.duration_s)
            where = f" | group: {record.group}" if self.section.debug else ""
            self._out(f"comm op: {record.op}{where} | time (ms): {record.duration_s * 1e3:.2f} | msg size: "
                      f"{format_size(record.nbytes)} | algbw (Gbps): {algbw:.2f} | busbw (Gbps): "
                      f"{algbw * bus_factor(record.op, record.group_size):.2f}")

    def rows(self) -> list[CommRow]:
        """The rows accumulated since the last `take`, by op (then group), then message size."""
        with self._lock:
            rows = list(self._rows.values())
        return sorted(rows, key=lambda r: (r.op, r.group or "", r.msg_bytes))

    def take(self) -> list[CommRow]:
        """The rows so far; the next summary starts from nothing."""
        with self._lock:
            rows = sorted(self._rows.values(), key=lambda r: (r.op, r.group or "", r.msg_bytes))
            self._rows = {}
        return rows

    def summary_lines(self, rows: list[CommRow], steps: int) -> list[str]:
        head = "comm op" if not self.section.debug else "comm op | group"
        lines = [f"communication over the last {steps} step(s):",
                 f"{head:<28}{'msg size':>12}{'count':>8}{'total (ms)':>12}{'avg (ms)':>10}"
                 f"{'algbw (Gbps)':>14}{'busbw (Gbps)':>14}"]
        for r in rows:
            name = r.op if r.group is None else f"{r.op} | {r.group}"
            lines.append(f"{name:<28}{format_size(r.msg_bytes):>12}{r.count:>8}{r.seconds * 1e3:>12.2f}"
                         f"{r.seconds * 1e3 / r.count:>10.3f}{r.algbw_gbps:>14.3f}{r.busbw_gbps:>14.3f}")
        return lines

    def log_summary(self, steps: int) -> None:
        """Print the rows of the last `steps` steps on global rank 0 (and start over on every rank)."""
        self._ledger.flush()       # GPU-timed operations still in flight: wait for their end events (printing)
        rows = self.take()
        if self.global_rank == 0 and rows:
            for line in self.summary_lines(rows, steps):
                self._out(line)


def print_line(stream: Callable[[], TextIO]) -> Callable[[str], None]:
    """A printer onto the stream `stream()` returns at each call (tests swap sys.stdout)."""
    def out(line: str) -> None:
        print(line, file=stream(), flush=True)
    return out
