"""Run a function on N gloo ranks and collect every rank's result or traceback.

    results = run_distributed(_check, world_size=4, args=(cfg,))   # one result per rank, rank order

`fn` must be importable (a module-level function): ranks are spawned processes. A failure on any rank
raises `DistributedTestError` carrying each failed rank's traceback; a rank that is still running when
the others have failed or the timeout passes is killed and reported as hung, so a test never hangs.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


class DistributedTestError(AssertionError):
    pass


def _worker(rank: int, world_size: int, init_file: str, backend: str, fn: Callable, args: tuple,
            kwargs: dict, results: "mp.Queue", threads: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    # gloo ranks compute on the CPU, also on a GPU machine, unless the caller chose CUDA (SHARDWISE_DEVICE=cuda:
    # gloo with CUDA tensors); NCCL ranks on their GPUs.
    os.environ.setdefault("SHARDWISE_DEVICE", "cpu" if backend == "gloo" else "cuda")
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        value = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(value, buf)     # bytes, not tensors: no shared-memory handles outlive this process
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        # Skip interpreter finalization (see shardwise.engine.initialize.exit_rank): first let the queue's feeder
        # thread deliver the result, then leave.
        results.close()
        results.join_thread()
        os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    kwargs: dict[str, Any] | None = None, *, timeout: float = 180.0,
                    backend: str = "gloo", grace: float = 10.0, threads_per_rank: int = 1) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` freshly spawned ranks with an initialized default
    process group; return the per-rank return values in rank order."""
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
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            outcomes[rank] = (ok, payload)
            if not ok:  # the others may now be blocked in a collective: give them a short grace
                deadline = min(deadline, time.monotonic() + grace)
        for p in procs:
            p.join(timeout=0.5 if len(outcomes) < world_size else 5)
            if p.is_alive():
                p.kill()
                p.join()
    failures = [f"--- rank {r} failed ---\n{payload}" for r, (ok, payload) in sorted(outcomes.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures or missing:
        msg = "\n".join(failures)
        if missing:
            msg += f"\nranks {missing} did not finish (hung or died; exit codes " \
                   f"{[procs[r].exitcode for r in missing]})"
        raise DistributedTestError(f"{fn.__name__} on {world_size} ranks:\n{msg}")
    return [torch.load(io.BytesIO(outcomes[r][1]), weights_only=False) for r in range(world_size)]
