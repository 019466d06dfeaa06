"""Per-rank record of every collective: the source of `engine.comm_report()`, of the planner's
validation and of hang and desync diagnostics.

A ledger is an ordinary object owned by the engine (no module global). Each `Comm` handle writes one
`CommRecord` per operation it launches; the engine opens a new step with `begin_step()`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class CommRecord:
    op: str            # "all_reduce", "ring_all_reduce", "broadcast", "all_gather", "reduce_scatter", "send", ...
    group: str         # a readable name of the group ("dp", "world", ...)
    group_size: int
    nbytes: int        # payload bytes of the tensor this rank contributes (numel * element size)
    dtype: str
    duration_s: float  # launch to completion, as seen by this rank (includes waiting for peers)
    step: int


@dataclass(frozen=True)
class InFlight:
    """An operation launched and not yet completed, as the hang report shows it."""

    op: str
    group: str
    seq: int           # 1-based count of this group's operations on this rank
    step: int
    started: float     # time.perf_counter() at launch
    signature: str = ""   # "float32[1024]"


_DRAINING_PRUNE_AT = 256


@dataclass
class _Completion:
    """Non-blocking tests of one operation: `done` (all must say True: its work, its end event) and `begun` (the
    GPU reached its start event; None: waiting from the launch on)."""

    done: list[Callable[[], bool]] = field(default_factory=list)
    begun: Callable[[], bool] | None = None
    seen_begun: float | None = None

    def completed(self) -> bool:
        if not self.done:
            return False
        try:
            return all(test() for test in self.done)
        except RuntimeError:       # a failed work raises from is_completed(): it is no longer waiting
            return True

    def waiting_since(self, now: float) -> float | None:
        """When the GPU was first seen to reach the operation (None: not yet; -inf: waiting since its launch)."""
        if self.begun is None:
            return float("-inf")
        if self.seen_begun is None and self.begun():
            self.seen_begun = now
        return self.seen_begun


def _chained(previous: bytes, text: str) -> bytes:
    return hashlib.blake2b(previous + text.encode(), digest_size=8).digest()


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
    """Thread-safe: gradient buckets complete on a communication thread while backward runs.

    For hang and desync diagnostics it also numbers the operations of each group (`seq`: the same on every member
    while the ranks are in step), keeps what is in flight, and folds each operation's signature (op, shape, dtype)
    into a running hash per group.

    [Note: timing on a GPU]
    On NCCL `wait()` returns as soon as the current stream has been told to wait for the collective, so host clocks
    around it read ~0. An operation on a CUDA tensor is timed with two CUDA events on the current stream: one
    recorded before the launch (the collective's stream waits for the work queued before it), one after `wait()`
    (queued behind the collective). Reading an event pair before the GPU reached the second would block the host,
    so such a record is kept aside and becomes a `CommRecord` (and reaches the listeners) once its end event has
    completed: checked without blocking at `begin_step`, waited for by `summary` and `flush` (reports only).

    [Note: waiting means not completed]
    The hang watchdog asks `waiting()` which operations this rank waits on. On gloo `wait()` returns when the
    collective is done, but on NCCL it returns at once, so "launched and not yet waited for" would say nothing
    about a stall. An operation therefore counts as waiting until it has completed: until its work says so
    (`work.is_completed()`, registered with `watch`), and on a CUDA tensor until the end event recorded after
    `wait()` has been reached by the GPU (queried, never synchronized). Its age on a GPU counts from the moment
    its start event was first seen reached: work queued ahead of it (the host runs a step ahead) is not waiting.
    """

    step: int = 0
    records: list[CommRecord] = field(default_factory=list)
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    keep_steps: int = 2
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _next_id: int = 0
    seq: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Operations launched per group name since the ledger was made."""
    last_done: InFlight | None = None
    """The operation completed last (what a rank outside any collective did last)."""
    _hashes: dict[str, bytes] = field(default_factory=dict, repr=False)
    """Running hash per group, not one for all: a communication thread (gradient buckets) and the autograd thread
    (TP) may interleave differently on each rank, but within one group the order is fixed, as the backends need."""
    _since_check: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list), repr=False)
    listeners: list[Callable[[CommRecord], None]] = field(default_factory=list)
    """Called with every record as it is made (the comms logger); on whichever thread completed the op."""
    explain: Callable[[BaseException], BaseException] | None = None
    """Turns a backend's failure of a collective (a timeout, a peer gone) into the run's own report (the hang
    watchdog's verdict); None: the failure stands as raised."""
    _events: dict[int, Any] = field(default_factory=dict, repr=False)
    """token -> the CUDA start event of an operation on a device tensor (see [Note: timing on a GPU])."""
    _unresolved: list[tuple[CommRecord, Any, Any]] = field(default_factory=list, repr=False)
    """(record with duration 0, start event, end event), in completion order, waiting for the end event."""
    _completion: dict[int, "_Completion"] = field(default_factory=dict, repr=False)
    _draining: dict[int, tuple[InFlight, "_Completion"]] = field(default_factory=dict, repr=False)
    """Operations waited for (`finish`) whose completion has not been seen yet (NCCL, CUDA events)."""
    """token -> how to tell that an operation has completed (see [Note: waiting means not completed])."""
    before_op: Callable[[str], None] | None = None
    """Called (outside the lock) with the group name before every operation is recorded: the desync check judges
    its pending result there, before the step's first collective can pair with a drifted rank's."""
    guard_groups: set[str] = field(default_factory=set)
    """Groups that carry only the guards' own collectives (the desync check): no backend check can fail there, so
    an aborting rank's failed collective is never one of theirs."""
    sequence_state: Callable[[], dict[str, Any]] | None = None
    """What the desync check knows of this rank's operations since the ranks last agreed (for a hang report)."""

    def begin_step(self, step: int) -> None:
        """Start recording for `step`; keep only the last `keep_steps` steps so memory stays bounded."""
        self.flush(block=False)
        with self._lock:
            self.step = step
            self.records = [r for r in self.records if r.step > step - self.keep_steps]

    def start(self, op: str, group: str, signature: str = "", *, device: torch.device | None = None) -> int:
        """Mark an operation as launched (read by hang diagnostics); returns a token for `finish`.
        `signature` ("float32[1024]") goes into the group's running hash with `op`. Call it before the launch;
        on a CUDA `device` a start event is recorded on its current stream."""
        if self.before_op is not None:
            self.before_op(group)
        event = None
        if device is not None and device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
        with self._lock:
            token = self._next_id
            self._next_id += 1
            self.seq[group] += 1
            self.in_flight[token] = InFlight(op, group, self.seq[group], self.step, time.perf_counter(), signature)
            text = f"{op} {signature}"
            self._hashes[group] = _chained(self._hashes.get(group, b""), text)
            self._since_check[group].append(text)
            if event is not None:
                self._events[token] = event
                self._completion[token] = _Completion(begun=event.query)
            return token

    def _prune_draining(self) -> None:
        """Forget the waited-for operations that have completed since (under the lock)."""
        for token, (info, completion) in list(self._draining.items()):
            if completion.completed():
                del self._draining[token]
                self.last_done = info

    def watch(self, token: int, completed: Callable[[], bool]) -> None:
        """Register a non-blocking completion test (`work.is_completed`) for an operation in flight: until it
        says True the operation counts as waiting, even after `finish`."""
        with self._lock:
            if token in self.in_flight:
                self._completion.setdefault(token, _Completion()).done.append(completed)

    def finish(self, token: int, *, op: str, group: str, group_size: int, nbytes: int, dtype: str) -> None:
        with self._lock:
            started = self.in_flight.pop(token, None)
            t0 = started.started if started is not None else time.perf_counter()
            event = self._events.pop(token, None)
            completion = self._completion.pop(token, None)
            ended = None
            if event is not None:     # after wait(): queued behind the collective on the current stream
                ended = torch.cuda.Event(enable_timing=True)
                ended.record()
                completion = completion or _Completion()
                completion.done.append(ended.query)
            if started is not None:
                if completion is not None and not completion.completed():
                    self._draining[token] = (started, completion)     # waited for, not yet completed
                    if len(self._draining) > _DRAINING_PRUNE_AT:      # nobody asks `waiting` (no watchdog)
                        self._prune_draining()
                else:
                    self.last_done = started
            if ended is not None:
                self._unresolved.append((CommRecord(op, group, group_size, nbytes, dtype, 0.0, self.step),
                                         event, ended))
                return
            record = CommRecord(op, group, group_size, nbytes, dtype, time.perf_counter() - t0, self.step)
            self.records.append(record)
        for listener in self.listeners:
            listener(record)

    def flush(self, block: bool = True) -> None:
        """Turn event-timed operations into records, in order: those whose end event has completed, or (block)
        all of them, waiting for the GPU."""
        done: list[CommRecord] = []
        with self._lock:
            while self._unresolved:
                record, started, ended = self._unresolved[0]
                if block:
                    ended.synchronize()
                elif not ended.query():
                    break
                self._unresolved.pop(0)
                seconds = started.elapsed_time(ended) / 1e3       # elapsed_time: milliseconds
                done.append(dataclasses.replace(record, duration_s=seconds))
            self.records.extend(done)
        for record in done:
            for listener in self.listeners:
                listener(record)

    def pending(self) -> list[tuple[str, str, float]]:
        """Operations launched and not finished: (op, group, seconds waiting)."""
        now = time.perf_counter()
        with self._lock:
            return [(f.op, f.group, now - f.started) for f in self.in_flight.values()]

    def waiting(self) -> list[InFlight]:
        """Operations launched and not completed, the oldest first (see [Note: waiting means not completed]);
        `started` is when the operation began waiting."""
        now = time.perf_counter()
        with self._lock:
            self._prune_draining()
            out = []
            entries = [(info, self._completion.get(token)) for token, info in self.in_flight.items()]
            entries += list(self._draining.values())
            for info, completion in entries:
                if completion is None:
                    out.append(info)
                elif not completion.completed():
                    since = completion.waiting_since(now)
                    if since is not None:
                        out.append(dataclasses.replace(info, started=max(info.started, since)))
            return sorted(out, key=lambda f: f.started)

    def fingerprint(self) -> int:
        """A 62-bit hash of every group's sequence of (op, signature) so far: equal on ranks that ran the same
        operations on each group, in each group's order. 62 bits: it and its negation fit an int64 max-reduce."""
        with self._lock:
            total = 0
            for group, h in self._hashes.items():
                total ^= int.from_bytes(hashlib.blake2b(group.encode() + h, digest_size=8).digest(), "little")
            return total >> 2

    def counts(self) -> dict[str, int]:
        """Operations launched per group so far (`seq`), copied."""
        with self._lock:
            return dict(self.seq)

    def peek_sequence(self) -> dict[str, list[str]]:
        """The operations of each group since the last `take_sequence`, left in place."""
        with self._lock:
            return {g: list(ops) for g, ops in self._since_check.items() if ops}

    def take_sequence(self) -> dict[str, list[str]]:
        """The operations of each group since the last call ("op signature" strings), for a desync report."""
        with self._lock:
            out = {g: list(ops) for g, ops in self._since_check.items()}
            self._since_check.clear()
            return out

    def summary(self, step: int | None = None) -> list[OpSummary]:
        """Collectives of one step (the current one by default), grouped by (op, group, dtype)."""
        self.flush()
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

    def report(self, step: int) -> list[dict[str, Any]]:
        """`comm_report()`'s rows for `step` (the engine's and the module wrappers'): op, group, group_size,
        dtype, count, bytes, seconds."""
        return [{"op": s.op, "group": s.group, "group_size": s.group_size, "dtype": s.dtype,
                 "count": s.count, "bytes": s.nbytes, "seconds": s.duration_s}
                for s in self.summary(step)]

    def bytes_by_op(self, step: int | None = None) -> dict[str, int]:
        totals: dict[str, int] = defaultdict(int)
        for s in self.summary(step):
            totals[s.op] += s.nbytes
        return dict(totals)
