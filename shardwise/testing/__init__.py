"""Run a function on N gloo ranks and collect every rank's result or traceback; a single-process
reference trainer for parity tests; the tiny GPT and token batches the tests share.

Used by every distributed test:

    results = run_distributed(_check, world_size=4, args=(cfg,))   # one result per rank, rank order

`fn` must be importable (a module-level function): ranks are spawned processes. A failure on any rank
raises `DistributedTestError` carrying each failed rank's traceback; a rank that is still running when
the others have failed or the timeout passes is killed and reported as hung, so a test never hangs.
The shared model and data helpers live here rather than in a conftest because ranks import them too.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Iterable, Sequence

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


# -- the tiny GPT and its data -----------------------------------------------------------------------

def tiny_gpt(*, n_layer: int = 2, d_model: int = 32, n_head: int = 4, seq_len: int = 16, vocab_size: int = 256,
             dropout: float = 0.0, seed: int | None = 1234, **overrides: Any) -> torch.nn.Module:
    """The "tiny" GPT preset shrunk to test size (2 layers, width 32, 4 heads, 16 tokens, byte vocabulary).
    `seed` seeds torch's global RNG right before the build, so equal arguments give equal weights; None
    draws from the RNG as it stands (a meta-device build, or a caller that seeded already). Other GPTConfig
    fields (positions, tie_embeddings, n_kv_head, ...) go through `overrides`."""
    from shardwise.models import GPT, gpt_config
    if seed is not None:
        torch.manual_seed(seed)
    return GPT(gpt_config("tiny", n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=seq_len,
                          vocab_size=vocab_size, dropout=dropout, **overrides))


def token_batches(count: int, rows: int, seq: int, *, seed: int, vocab: int = 256) -> list[torch.Tensor]:
    """`count` batches of random token ids, each [rows, seq], drawn in order from one generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(count)]


def lm_pair(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows [b, s + 1] as a language-model micro-batch: inputs [b, s] and next-token labels [b, s]."""
    return rows[:, :-1], rows[:, 1:]


def micro_steps(batches: Iterable[torch.Tensor], *, grad_accum: int, dp_size: int = 1,
                dp_rank: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per global batch [B, s + 1], the (inputs, labels) micro-batches rank `dp_rank` trains on; with the
    defaults (one rank), the single-process reference's steps for `reference_train`."""
    return [[lm_pair(m) for m in shard_global_batch(b, dp_size=dp_size, dp_rank=dp_rank, grad_accum=grad_accum)]
            for b in batches]


def state_copy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the module's state dict (the module keeps training; the copy does not move)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def mean_over_ranks(value: float) -> float:
    """The mean of a per-rank float over the default group (e.g. the data-parallel mean of a loss)."""
    t = torch.tensor([float(value)])
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


# -- single-process reference -----------------------------------------------------------------------

def reference_train(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    steps: Iterable[Sequence[Any]], *, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                    clip: float | None = None,
                    scheduler: Any = None) -> list[float]:
    """Plain torch training: for each step, the micro-batches' mean loss is backpropagated (each
    micro-batch's loss divided by their count, as DeepSpeed does), optionally clipped, then stepped.
    Returns the per-step mean loss."""
    losses = []
    for micro_batches in steps:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in micro_batches:
            loss = loss_fn(model, mb)
            (loss / len(micro_batches)).backward()
            total += float(loss.detach())
        if clip is not None and clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(total / len(micro_batches))
    return losses


def shard_global_batch(batch: torch.Tensor, *, dp_size: int, dp_rank: int, grad_accum: int) -> list[torch.Tensor]:
    """The micro-batches rank `dp_rank` sees of a global batch [B, ...], B = grad_accum * dp * micro:
    micro-step k of rank r is rows [(k * dp + r) * micro, ... + micro)."""
    micro = batch.shape[0] // (grad_accum * dp_size)
    if micro * grad_accum * dp_size != batch.shape[0]:
        raise ValueError(f"global batch {batch.shape[0]} != grad_accum {grad_accum} * dp {dp_size} * micro")
    return [batch[(k * dp_size + dp_rank) * micro:(k * dp_size + dp_rank + 1) * micro] for k in range(grad_accum)]


def assert_close_lists(actual: Sequence[float], expected: Sequence[float], *, rtol: float = 1e-5,
                       atol: float = 0.0, what: str = "values") -> None:
    a, e = torch.tensor(list(actual), dtype=torch.float64), torch.tensor(list(expected), dtype=torch.float64)
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}\n{a}\nvs\n{e}")


def assert_close_growing(actual: Sequence[float], expected: Sequence[float], *, rtol_per_step: float,
                         steps: Sequence[int], what: str = "values") -> None:
    """|actual[i] - expected[i]| <= steps[i] * rtol_per_step * |expected[i]|: a tolerance that grows with the
    number of steps (optimizer updates, say) behind each value, as rounding differences accumulate over them.
    A value with 0 steps behind it must be equal."""
    assert len(actual) == len(expected) == len(steps), (what, len(actual), len(expected), len(steps))
    for i, (a, e, n) in enumerate(zip(actual, expected, steps)):
        a, e = float(a), float(e)
        rtol = n * rtol_per_step
        assert abs(a - e) <= rtol * abs(e), (f"{what}: element {i} ({n} steps in): {a!r} vs {e!r}, relative "
                                             f"difference {abs(a - e) / abs(e):.1e} > {rtol:.1e}")


def assert_state_close(actual: dict, expected: dict, *, what: str, adam: bool = False, rtol: float = 1e-5,
                       atol: float = 1e-5) -> None:
    """Every tensor of a gathered state dict equals the reference's (same keys). With `adam`, the attention
    k_proj biases are skipped: their true gradient is exactly 0 (softmax is shift-invariant per query), and
    Adam's m / sqrt(v) turns the rounding noise of a different reduction order into +-lr steps
    (docs/design.md, tolerances)."""
    assert actual.keys() == expected.keys(), f"{what}: keys {sorted(actual.keys() ^ expected.keys())} differ"
    for k, v in expected.items():
        if adam and k.endswith("k_proj.bias"):
            continue
        torch.testing.assert_close(actual[k], v, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{what} {k}: {m}")


# -- FLOP counts ---------------------------------------------------------------------------------------

def gpt_forward_flops(model: torch.nn.Module, tokens: int) -> tuple[int, int]:
    """A GPT's forward FLOPs over `tokens` tokens as the flops profiler counts them, and their gap to the
    analytic count (`model.flops_per_token()` / 3, the forward share of training). The analytic count prices
    every norm and bias parameter (the 1-D ones) at 2 FLOPs per token; the profiler prices only matmuls and
    attention, so it counts exactly that much less."""
    analytic = model.flops_per_token() * tokens // 3
    elementwise = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    return analytic - 2 * elementwise * tokens, 2 * elementwise * tokens


# -- host reads ---------------------------------------------------------------------------------------

_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


class HostReadCounter:
    """Counts calls that copy a tensor's value to the host (`.item()`, `.tolist()`, `.cpu()`, `float(t)`,
    `bool(t)`, ...: on a GPU each waits for the device) made by code in `package` (shardwise's own files, not
    torch's or the test's). On the CPU they are cheap, but each is a synchronisation point on a GPU, so the count
    is what the engine would wait for there. Use as a context manager; `calls` lists (method, file:line)."""

    def __init__(self, package: str | None = None):
        import shardwise
        self.package = package or os.path.dirname(os.path.abspath(shardwise.__file__))
        self.calls: list[tuple[str, str]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "HostReadCounter":
        import sys

        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def spy(t: torch.Tensor, *args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                frame = sys._getframe(1)
                where = frame.f_code.co_filename
                if where.startswith(self.package) and not where.endswith("testing.py"):
                    self.calls.append((_name, f"{os.path.relpath(where, self.package)}:{frame.f_lineno}"))
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, name, spy)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}

    def take(self) -> list[tuple[str, str]]:
        """The calls so far; the count starts over."""
        calls, self.calls = self.calls, []
        return calls
