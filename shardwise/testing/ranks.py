"""Run a function on N gloo ranks and collect every rank's result or traceback.

    results = run_distributed(_check, world_size=4, args=(cfg,))   # one result per rank, rank order

`fn` must be importable (a module-level function): ranks are spawned processes. A failure on any rank
raises `DistributedTestError` carrying each failed rank's traceback; a rank that is still running when
the others have failed or the timeout passes is killed and reported as hung, so a test never hangs.

Warm ranks. Spawning a rank costs an interpreter and an `import torch` (about 2 s of CPU each, 4-8 s of wall time
for a 4-rank launch on two cores), which is most of a small distributed test. With `SHARDWISE_TEST_RANK_POOL=1`
(the test suite sets it) the ranks of a launch are kept and reused by the next launch of the same size from the
same test module: each call still gets a fresh default process group, and the process-wide state a test can change
(environment, default dtype, grad mode, threads, signal handlers) is put back after it. A rank is retired instead
of reused when its call failed, left a thread running (a watchdog, a monitor) or did not finish its teardown in
time, so nothing of one call can act inside the next. `fresh=True` always spawns.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from shardwise.comm.watchdog import stop_all_watchdogs


POOL_ENV = "SHARDWISE_TEST_RANK_POOL"


class DistributedTestError(AssertionError):
    pass


# Signals whose handlers a call may install (the CLI's stop handling, fault tests); restored after each call.
_SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP))


def _rank_env(rank: int, world_size: int, backend: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    # gloo ranks compute on the CPU, also on a GPU machine, unless the caller chose CUDA (SHARDWISE_DEVICE=cuda:
    # gloo with CUDA tensors); NCCL ranks on their GPUs.
    os.environ.setdefault("SHARDWISE_DEVICE", "cpu" if backend == "gloo" else "cuda")


def _run_call(rank: int, world_size: int, init_file: str, backend: str, fn: Callable, args: tuple,
              kwargs: dict) -> tuple[bool, Any]:
    """One call in a group of its own: (True, the pickled value) or (False, the traceback)."""
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        value = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(value, buf)     # bytes, not tensors: no shared-memory handles outlive this process
        return True, buf.getvalue()
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        return False, traceback.format_exc()
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _worker(rank: int, world_size: int, init_file: str, backend: str, fn: Callable, args: tuple,
            kwargs: dict, results: "mp.Queue", threads: int) -> None:
    """A rank for one call."""
    _rank_env(rank, world_size, backend)
    torch.set_num_threads(threads)
    ok, payload = _run_call(rank, world_size, init_file, backend, fn, args, kwargs)
    results.put((0, rank, ok, payload))
    # Skip interpreter finalization (see shardwise.engine.initialize.exit_rank): first let the queue's feeder
    # thread deliver the result, then leave.
    results.close()
    results.join_thread()
    os._exit(0)


@dataclass
class _Saved:
    """What a call may change in its process, taken before it and put back after it."""
    environ: dict[str, str]
    cwd: str
    dtype: torch.dtype
    grad: bool
    deterministic: bool
    handlers: dict[int, Any]
    threads: set[threading.Thread] = field(default_factory=set)

    @classmethod
    def take(cls) -> "_Saved":
        return cls(dict(os.environ), os.getcwd(), torch.get_default_dtype(), torch.is_grad_enabled(),
                   torch.are_deterministic_algorithms_enabled(), {s: signal.getsignal(s) for s in _SIGNALS},
                   set(threading.enumerate()))

    def restore(self, threads: int) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_num_threads(threads)
        for s, handler in self.handlers.items():
            if handler is not None:
                signal.signal(s, handler)

    def threads_left(self) -> list[threading.Thread]:
        """Threads the call started that are still running, after a short wait for those that are ending."""
        deadline = time.monotonic() + 0.5
        while True:
            left = [t for t in threading.enumerate() if t not in self.threads and t.is_alive()
                    and not t.name.startswith("QueueFeederThread")]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.02)


def _pool_worker(rank: int, world_size: int, backend: str, jobs: "mp.Queue", results: "mp.Queue",
                 threads: int) -> None:
    """A warm rank: runs calls until told to stop, or until a call leaves something behind."""
    _rank_env(rank, world_size, backend)
    torch.set_num_threads(threads)
    while True:
        job = jobs.get()
        if job is None:
            break
        # A spawned rank inherits its parent's environment, directory and import path as they are at the launch:
        # a warm one takes them from each call.
        call_id, init_file, environ, cwd, path, fn, args, kwargs = pickle.loads(job)
        saved = _Saved.take()
        os.environ.clear()
        os.environ.update(environ)
        _rank_env(rank, world_size, backend)
        os.chdir(cwd)
        sys.path[:] = path
        ok, payload = _run_call(rank, world_size, init_file, backend, fn, args, kwargs)
        # What a fresh rank's exit does for the engines it built: their hang watchdogs stop.
        stop_all_watchdogs()
        left = saved.threads_left()
        saved.restore(threads)
        results.put((call_id, rank, ok, payload))
        # Teardown done: say whether this rank can take the next call.
        reusable = ok and not left
        results.put((call_id, rank, "ready" if reusable else "retired", None))
        if not reusable:
            break
    results.close()
    results.join_thread()
    os._exit(0)


class _Pool:
    """The warm ranks of one (world size, backend, threads, test module)."""

    def __init__(self, world_size: int, backend: str, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.results: mp.Queue = ctx.Queue()
        self.jobs: list[mp.Queue] = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_pool_worker, daemon=True,
                                  args=(r, world_size, backend, self.jobs[r], self.results, threads))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.calls = 0

    def close(self) -> None:
        for q, p in zip(self.jobs, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[tuple[int, str, int, str], _Pool] = {}


def _pool_for(world_size: int, backend: str, threads: int, module: str) -> _Pool:
    # One test module's ranks at a time: a module's tests are alike, and few processes stay alive.
    for key in [k for k in _POOLS if k[3] != module]:
        _POOLS.pop(key).close()
    key = (world_size, backend, threads, module)
    if key not in _POOLS:
        _POOLS[key] = _Pool(world_size, backend, threads)
    return _POOLS[key]


def _collect(results: "mp.Queue", procs: list, world_size: int, timeout: float, grace: float,
             call_id: int, states: dict[int, str] | None = None) -> dict[int, tuple[bool, Any]]:
    """Every rank's outcome of call `call_id`, or fewer when ranks hang or die. A warm rank's word on its
    teardown ("ready" / "retired") that arrives meanwhile goes into `states`."""
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            cid, rank, ok, payload = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            if any(not procs[r].is_alive() for r in range(world_size) if r not in outcomes) and results.empty():
                # A rank died without a word: the others may wait on it in a collective; grace, then judge.
                deadline = min(deadline, time.monotonic() + grace)
            continue
        if cid != call_id:
            continue
        if isinstance(ok, str):
            if states is not None:
                states[rank] = ok
            continue
        outcomes[rank] = (ok, payload)
        if not ok:  # the others may now be blocked in a collective: give them a short grace
            deadline = min(deadline, time.monotonic() + grace)
    return outcomes


def _settled(pool: _Pool, call_id: int, world_size: int, states: dict[int, str], timeout: float = 30.0) -> bool:
    """Whether every rank finished its teardown and can take another call (`states`: the words already read)."""
    if any(state != "ready" for state in states.values()):
        return False
    ready = set(states)
    deadline = time.monotonic() + timeout
    while len(ready) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            cid, rank, state, _ = pool.results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            if any(not p.is_alive() for p in pool.procs):
                return False
            continue
        if cid != call_id:
            continue
        if state != "ready":
            return False
        ready.add(rank)
    return True


def _raise_on_failures(fn: Callable, world_size: int, outcomes: dict[int, tuple[bool, Any]],
                       exitcodes: list[int | None]) -> None:
    failures = [f"--- rank {r} failed ---\n{payload}" for r, (ok, payload) in sorted(outcomes.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures or missing:
        msg = "\n".join(failures)
        if missing:
            msg += f"\nranks {missing} did not finish (hung or died; exit codes " \
                   f"{[exitcodes[r] for r in missing]})"
        raise DistributedTestError(f"{fn.__name__} on {world_size} ranks:\n{msg}")


def _pooled(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float, backend: str,
            grace: float, threads: int) -> dict[int, tuple[bool, Any]]:
    pool = _pool_for(world_size, backend, threads, getattr(fn, "__module__", ""))
    key = (world_size, backend, threads, getattr(fn, "__module__", ""))
    pool.calls += 1
    call_id = pool.calls
    with tempfile.TemporaryDirectory(prefix="shardwise-test-") as tmp:
        init_file = os.path.join(tmp, "store")
        # Pickled here, so a function or argument that cannot be pickled fails this call at once (as a spawn does)
        # instead of in the queue's feeder thread.
        job = bytes(ForkingPickler.dumps((call_id, init_file, dict(os.environ), os.getcwd(), list(sys.path), fn,
                                          args, kwargs)))
        for q in pool.jobs:
            q.put(job)
        states: dict[int, str] = {}
        outcomes = _collect(pool.results, pool.procs, world_size, timeout, grace, call_id, states)
        complete = len(outcomes) == world_size and all(ok for ok, _ in outcomes.values())
        if not (complete and _settled(pool, call_id, world_size, states)):
            # A failed, hung or retired rank: nothing of this pool is trusted with another call.
            _POOLS.pop(key, None)
            pool.close()
        exitcodes = [p.exitcode for p in pool.procs]
    _raise_on_failures(fn, world_size, outcomes, exitcodes)
    return outcomes


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    kwargs: dict[str, Any] | None = None, *, timeout: float = 180.0,
                    backend: str = "gloo", grace: float = 10.0, threads_per_rank: int = 1,
                    fresh: bool = False) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks with an initialized default process group; return the
    per-rank return values in rank order. Ranks are freshly spawned unless warm ranks are enabled (module doc)
    and `fresh` is False."""
    if os.environ.get(POOL_ENV) == "1" and not fresh:
        outcomes = _pooled(fn, world_size, tuple(args), dict(kwargs or {}), timeout, backend, grace,
                           threads_per_rank)
        return [torch.load(io.BytesIO(outcomes[r][1]), weights_only=False) for r in range(world_size)]
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="shardwise-test-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, init_file, backend, fn, tuple(args), dict(kwargs or {}),
                                   results, threads_per_rank))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outcomes = _collect(results, procs, world_size, timeout, grace, 0)
        for p in procs:
            p.join(timeout=0.5 if len(outcomes) < world_size else 5)
            if p.is_alive():
                p.kill()
                p.join()
    _raise_on_failures(fn, world_size, outcomes, [p.exitcode for p in procs])
    return [torch.load(io.BytesIO(outcomes[r][1]), weights_only=False) for r in range(world_size)]


def close_warm_ranks() -> None:
    """End every warm rank (the suite's end; a test that needs the machine's cores to itself)."""
    while _POOLS:
        _POOLS.popitem()[1].close()
