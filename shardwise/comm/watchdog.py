"""Hang reports: when a collective waits longer than communication.timeout_minutes, every rank says from its
ledger where it is, and the run ends with one line naming the ranks that did not arrive, or, when the reports
show ranks waiting in collectives that cannot pair, the desync it is (`DesyncError`).

"Waiting" means not completed (`CommLedger.waiting`): on NCCL `wait()` returns at once, so a collective counts
until its work says it completed or the GPU reached the event recorded behind it.

The reports travel over the store the process group was built on (torchrun's TCPStore, the test harness's
FileStore), never over the hung communicator; `HangWatchdog.attach(ledger, ...)` starts one daemon thread per rank.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import json
import os
import sys
import threading
import time
import weakref
from typing import Any

from shardwise.comm.abort import is_gloo_check, on_terminate
from shardwise.comm.ledger import CommLedger
from shardwise.comm.sequence import desync_in_reports
from shardwise.errors import CollectiveTimeout, DesyncError

QUIET_ENV = "SHARDWISE_WATCHDOG_QUIET"
"""Set (to 1) by `shardwise train` for its ranks: a rank posts its report without printing it, as the launcher
prints the verdict once for all (the per-rank lines would bury it)."""

_instances = itertools.count()
"""Watchdogs made in this process: every rank makes them in the same order, so the n-th shares a store prefix."""


def cadence(timeout_s: float) -> tuple[float, float, float]:
    """(tick, idle poll, grace) in seconds for a timeout: how often the thread looks at the ledger, how often an
    idle rank reads the store, and how long the reporter waits for the other reports."""
    tick = min(max(timeout_s / 20, 0.05), 1.0)
    idle_poll = min(max(timeout_s / 4, tick), 5.0)
    return tick, idle_poll, idle_poll + 2 * tick + 1.0


def _margin(timeout_s: float) -> float:
    return min(5.0, max(1.0, timeout_s / 10))


def backend_timeout_s(timeout_s: float) -> float:
    """What the process groups are given: after the watchdog's verdict (grace), plus a margin (1-5 s) for the
    report, so a rank blocked in gloo raises after the verdict exists; `Comm` hands that failure to
    `HangWatchdog.explain`, which raises `CollectiveTimeout` with the verdict instead."""
    return timeout_s + cadence(timeout_s)[2] + _margin(timeout_s)


def _default_store() -> Any | None:
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def describe(report: dict[str, Any]) -> str:
    """One rank's report as words: 'step 3, waiting 4.1 s in all_reduce on "dp" #18'."""
    where = f"step {report['step']}"
    if report.get("op"):
        return f'{where}, waiting {report["age"]:.1f} s in {report["op"]} on "{report["group"]}" #{report["seq"]}'
    last = report.get("last")
    done = f', last completed {last["op"]} on "{last["group"]}" #{last["seq"]}' if last else ""
    return f"{where}, outside any collective{done}"


def verdict(reports: dict[int, dict[str, Any] | None], timeout_s: float) -> str:
    """The one line: the desync the reports show (`desync_in_reports`); else, when some ranks did not arrive (no
    report, or not in a collective), those ranks first, what the others waited in for them and how long; else
    (every rank waits in one collective that does not complete) what they wait on."""
    desync = desync_in_reports(reports)
    if desync is not None:
        return desync
    absent = [r for r, rep in sorted(reports.items()) if rep is None]
    idle = [(r, rep) for r, rep in sorted(reports.items()) if rep is not None and not rep.get("op")]
    waits: dict[tuple[str, str, int], list[int]] = {}
    ages: dict[tuple[str, str, int], float] = {}
    for r, rep in sorted(reports.items()):
        if rep is not None and rep.get("op"):
            key = (rep["op"], rep["group"], rep["seq"])
            waits.setdefault(key, []).append(r)
            ages[key] = max(ages.get(key, 0.0), float(rep.get("age", 0.0)))
    steps = sorted({rep["step"] for rep in reports.values() if rep is not None})
    at = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
    timeout = f"collective timeout at {at} after {timeout_s:g} s (communication.timeout_minutes)"
    late = absent + [r for r, _ in idle]
    if not late:
        return f"{timeout}: " + "; ".join(f'rank(s) {_ranks(ranks)} wait in {op} on "{group}" #{seq}'
                                          for (op, group, seq), ranks in waits.items())
    # A stall: the ranks that did not arrive lead the line (a launcher's later kill of them is a consequence).
    detail = "; ".join([f"rank {r}: {describe(rep)}" for r, rep in idle[:4]]
                       + [f"rank {r}: no report (process gone or frozen)" for r in absent[:4]])
    waited = "; ".join(f'rank(s) {_ranks(ranks)} waited {ages[key]:.0f} s for them in {key[0]} on "{key[1]}" '
                       f'#{key[2]}' for key, ranks in waits.items())
    return (f"rank(s) {_ranks(sorted(late))} stalled: {waited or 'no rank reported waiting'} ({timeout}); "
            f"rank(s) {_ranks(sorted(late))} did not arrive ({detail})")


_ABORT_HOOK: list[bool] = []
"""Whether this process's terminate handler reports (set once, by the first watchdog)."""
_LIVE: "weakref.WeakSet[HangWatchdog]" = weakref.WeakSet()
"""Every started watchdog still referenced: one exit handler stops them all (a process may build many engines)."""


def stop_all_watchdogs() -> None:
    """Stop every live watchdog and let its thread leave its store call. At exit: a daemon thread still inside a
    store call when finalization stops it unwinds through C++ frames that may not throw, and the process aborts
    ("terminate called without an active exception") after a run that had finished. Also for a process that
    outlives its engines and their world (the test suite's warm ranks)."""
    dogs = list(_LIVE)
    for dog in dogs:
        dog.stop()
    for dog in dogs:
        dog.join(timeout_s=10.0)


atexit.register(stop_all_watchdogs)


def _report_before_abort(reason: str | None) -> None:
    """The process is aborting (`comm.abort`: a backend's check failed on its own thread, `reason` the C++
    exception's type): every live watchdog reports at once."""
    for dog in list(_LIVE):
        dog.report_before_abort(reason)


class HangWatchdog:
    """One per engine on every rank of a world > 1 (`attach` launches the thread). Holds its ledger weakly: the
    thread ends with the engine, or at `stop()`.

    The thread, on each rank:
    - while an operation of this rank's ledger has waited >= `timeout_s`, it posts its report (step, op, group, the
      group's sequence number, how long) under `<prefix>/report/<rank>` and bumps `<prefix>/declared`; the first
      to bump it is the reporter;
    - otherwise it looks at `<prefix>/declared` every `idle_poll_s` (at most every 5 s: a store read, nothing on
      the communicators) and, once a timeout is declared, posts its own report too: outside any collective, the
      last operation it completed (a stalled rank), or what it waits on (a rank that arrived late);
    - the reporter waits `grace_s` for everyone's report, then writes the verdict line under `<prefix>/verdict`.
    A verdict nobody raised within the backend's margin (NCCL aborts the process itself) is printed.
    """

    def __init__(self, ledger: CommLedger, *, store: Any, rank: int, world: int, timeout_s: float):
        self._ledger = weakref.ref(ledger)
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.tick, self.idle_poll, self.grace = cadence(timeout_s)
        self.prefix = f"shardwise/hang/{next(_instances)}"
        self._stop = threading.Event()
        self._reported = False
        self._verdict: str | None = None
        self._raised = False
        self._reporter = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="shardwise-hang-watchdog", daemon=True)

    @classmethod
    def attach(cls, ledger: CommLedger, *, rank: int, world: int, timeout_s: float,
               store: Any | None = None) -> "HangWatchdog | None":
        """A started watchdog explaining `ledger`'s failures, or None in a world of one (or without a store).
        `store`: where the reports go (default: the store the default process group was built on)."""
        store = store if store is not None else _default_store()
        if store is None:
            return None
        dog = cls(ledger, store=store, rank=rank, world=world, timeout_s=timeout_s)
        ledger.explain = dog.explain
        dog._thread.start()
        _LIVE.add(dog)
        if not _ABORT_HOOK:
            _ABORT_HOOK.append(on_terminate(_report_before_abort))
        return dog

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        """Wait for the thread to end (after `stop`)."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # -- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        last_poll = time.monotonic()
        declared_at: float | None = None
        while not self._stop.wait(self.tick):
            ledger = self._ledger()
            if ledger is None:
                return
            try:
                if self._verdict is not None:
                    self._print_unraised(declared_at)
                    continue
                waiting = ledger.waiting()
                age = time.perf_counter() - waiting[0].started if waiting else 0.0
                now = time.monotonic()
                if not self._reported and (age >= self.timeout_s or now - last_poll >= self.idle_poll):
                    last_poll = now
                    if age >= self.timeout_s or self.store.check([f"{self.prefix}/declared"]):
                        # after a peer's abort the lines are its desync's: no line of our own
                        quiet = self.store.check([f"{self.prefix}/abort"])
                        if self._report(ledger, quiet=quiet) == 1:
                            declared_at = now
                            self._reporter = True
                if declared_at is not None and now - declared_at >= self.grace and self._verdict is None:
                    self._publish_verdict()
                elif self._reported and self.store.check([f"{self.prefix}/verdict"]):
                    self._verdict = self.store.get(f"{self.prefix}/verdict").decode()
                    declared_at = now
            except Exception:   # noqa: BLE001 - a store gone with the job: nothing left to report to
                return
            finally:
                del ledger

    def _report(self, ledger: CommLedger, quiet: bool = False, aborted: str | None = None) -> int:
        """Post this rank's report (once; `quiet`: without printing it; `aborted`: the C++ exception ending this
        process); returns the declaration count (1: this rank is the reporter)."""
        with self._lock:
            if self._reported:
                return 0
            self._reported = True
        waiting = ledger.waiting()
        if aborted is not None:     # the collective that failed: not the check still completing beside it
            waiting = [w for w in waiting if w.group not in ledger.guard_groups]
        report: dict[str, Any] = {"step": ledger.step, "counts": ledger.counts()}
        if waiting:
            w = waiting[0]
            report.update(op=w.op, group=w.group, seq=w.seq, age=time.perf_counter() - w.started, step=w.step,
                          signature=w.signature)
        elif ledger.last_done is not None:
            d = ledger.last_done
            report["last"] = {"op": d.op, "group": d.group, "seq": d.seq}
        if ledger.sequence_state is not None:
            report["seq_state"] = ledger.sequence_state()
        if aborted is not None:
            report["aborted"] = aborted
        self.store.set(f"{self.prefix}/report/{self.rank}", json.dumps(report))
        if not quiet and not os.environ.get(QUIET_ENV):
            print(f"shardwise: rank {self.rank}: {describe(report)}", file=sys.stderr, flush=True)
        return int(self.store.add(f"{self.prefix}/declared", 1))

    def _publish_verdict(self) -> None:
        self._verdict = verdict(self._collect(), self.timeout_s)
        self.store.set(f"{self.prefix}/verdict", self._verdict)

    def _collect(self) -> dict[int, dict[str, Any] | None]:
        out: dict[int, dict[str, Any] | None] = {}
        for r in range(self.world):
            key = f"{self.prefix}/report/{r}"
            out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return out

    def _print_unraised(self, declared_at: float | None) -> None:
        # The main thread raises the verdict when its backend gives up (grace + margin after the declaration);
        # NCCL may abort the process instead. Then the reporter alone prints it, so the run still ends with the line.
        if (self._reporter and not self._raised and declared_at is not None
                and time.monotonic() - declared_at > self.grace + _margin(self.timeout_s) + 3.0):
            self._raised = True
            print(f"shardwise: error: {self._verdict}", file=sys.stderr, flush=True)

    # -- the aborting thread ----------------------------------------------------------------------------
    def report_before_abort(self, reason: str | None = None) -> None:
        """On the thread that aborts the process. Two cases:
        - gloo's size check failed (a collective of another size on a peer): this rank declares at once, waits
          (the grace period) for the other ranks' reports, which show what each ran since the ranks last agreed,
          and publishes the verdict if it is a desync; then it ends quietly (exit 1): the peers' collectives fail
          as it leaves, and they raise the verdict's `DesyncError` (`explain`), one line. Anything else is left to
          the backend's own abort (and the peers to their backend's error).
        - a hang was declared before and the backend now gives up (NCCL's watchdog aborts where gloo would raise):
          the main thread, blocked in a device read, will never raise the verdict, so the reporter prints it and
          every rank ends with exit 1 instead of the backend's abort text.
        """
        ledger = self._ledger()
        if ledger is None or self._stop.is_set():      # an engine closed earlier in this process
            return
        try:
            hang_declared = self._reported or self.store.check([f"{self.prefix}/verdict"])
            if not hang_declared:
                # gloo's failed check in a collective not launched through a `Comm` (the ledger shows none
                # in flight) is reported too: the peers' reports still show where they wait
                if not ledger.waiting() and not is_gloo_check(reason):
                    return
                self.store.set(f"{self.prefix}/abort", str(self.rank))
                if self._report(ledger, quiet=True, aborted=reason) == 1:
                    keys = [f"{self.prefix}/report/{r}" for r in range(self.world)]
                    try:
                        self.store.wait(keys, datetime.timedelta(seconds=self.grace))
                    except RuntimeError:       # a rank that does not report in time is named as such
                        pass
                    found = verdict(self._collect(), self.timeout_s)
                    if not found.startswith("desync"):
                        return
                    self._verdict = found
                    self.store.set(f"{self.prefix}/verdict", found)
                    sys.stderr.flush()
                    os._exit(1)
            deadline = time.monotonic() + self.grace + 2.0
            while not self.store.check([f"{self.prefix}/verdict"]) and time.monotonic() < deadline:
                time.sleep(self.tick)
            if not self.store.check([f"{self.prefix}/verdict"]):
                return
            self._verdict = self.store.get(f"{self.prefix}/verdict").decode()
        except Exception:   # noqa: BLE001 - the store is gone too: the backend's abort is all there is
            return
        if not hang_declared and not self._verdict.startswith("desync"):
            return
        if hang_declared and self._reporter and not self._raised:
            self._raised = True
            print(f"shardwise: error: {self._verdict}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)

    # -- the main thread -------------------------------------------------------------------------------
    def explain(self, error: BaseException) -> BaseException:
        """A backend failure as the verdict, once there is one (waited for up to the grace period). A failure
        with no timeout declared (a peer process gone) is left as the backend raised it: that is a crash, which
        the launcher reports, not a hang."""
        try:
            if self._verdict is None and not self.store.check([f"{self.prefix}/declared"]):
                return error
        except Exception:   # noqa: BLE001 - the store is gone too: the backend's error is all there is
            return error
        deadline = time.monotonic() + self.grace + 1.0 + 2 * self.tick
        while self._verdict is None and time.monotonic() < deadline:
            try:
                if self.store.check([f"{self.prefix}/verdict"]):
                    self._verdict = self.store.get(f"{self.prefix}/verdict").decode()
                    break
            except Exception:   # noqa: BLE001
                break
            time.sleep(self.tick)
        if self._verdict is None:
            return error
        self._raised = True
        if self._verdict.startswith("desync"):
            return DesyncError(self._verdict)
        return CollectiveTimeout(self._verdict)
