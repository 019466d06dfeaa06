"""Our ring all-reduce against gloo's `dist.all_reduce` and against float64 sums.

Spawning ranks costs seconds, so each world size runs every case inside ONE `run_distributed` call.
Ranks never raise on a wrong result (that would leave the others blocked in the next collective): they
collect failure messages and return them; the test asserts the lists are empty.

Exactness: integer dtypes, bool, and floats holding small integers (whose sums are exact in any order)
must match gloo bit for bit; so must MAX/MIN, and PRODUCT over powers of two. Random floats must lie
within the recursive-summation bound (N-1) * eps * sum|x_i| of the exact (float64) sum.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.comm import Comm, CommLedger, ring_all_reduce
from shardwise.comm.ring import DEFAULT_IN_FLIGHT, DEFAULT_SEGMENT_BYTES, RingPlan
from shardwise.testing import run_distributed

SMALL_SEGMENT = 4096     # bytes: a few thousand elements already span many segments


@dataclass(frozen=True)
class Case:
    numel: int
    dtype: torch.dtype
    op: str = "SUM"                  # a dist.ReduceOp member name (names pickle; enum values may not)
    exact: bool = True               # values whose reduction is exact in any order
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    in_flight: int = DEFAULT_IN_FLIGHT

    def __str__(self) -> str:
        return (f"numel={self.numel} {self.dtype} {self.op} exact={self.exact} "
                f"segment_bytes={self.segment_bytes} in_flight={self.in_flight}")


def _sizes(n: int) -> list[int]:
    return sorted({0, 1, n - 1, n, n + 1, 2 * n + 1, 7, 13, 97, 1009, 65_537})


def _cases(n: int, *, full: bool) -> list[Case]:
    if not full:   # eight ranks on a small machine: a few cases covering empty, ragged and segmented
        return ([Case(m, torch.int64) for m in (0, 1, n - 1, n, n + 1, 2 * n + 1, 1009)]
                + [Case(1009, torch.bfloat16), Case(4099, torch.float32, exact=False),
                   Case(20_011, torch.int32, segment_bytes=SMALL_SEGMENT, in_flight=2)])
    cases = [Case(m, dt) for m in _sizes(n)
             for dt in (torch.float32, torch.int64, torch.int32, torch.uint8, torch.bfloat16)]
    cases += [Case(m, dt) for m in (n + 1, 1009) for dt in (torch.float64, torch.float16, torch.int8, torch.bool)]
    cases += [Case(m, torch.float32, exact=False) for m in (1, n + 1, 4099, 65_537)]
    cases += [Case(m, dt, exact=False) for m in (n + 1, 1013) for dt in (torch.float64, torch.float16, torch.bfloat16)]
    cases += [Case(m, dt, op) for m in (n + 1, 1009) for op in ("MAX", "MIN", "PRODUCT")
              for dt in (torch.float32, torch.int64, torch.uint8)]
    cases += [Case(1009, dt, op) for op in ("BAND", "BOR", "BXOR") for dt in (torch.int32, torch.bool)]
    # segmentation: many small segments, every window depth, sizes that leave ragged/empty segments
    cases += [Case(m, torch.int64, segment_bytes=SMALL_SEGMENT, in_flight=f)
              for m in (1, n * 512 - 1, 10_007) for f in (1, 2, 3, 8)]
    cases += [Case(20_011, torch.float32, exact=False, segment_bytes=SMALL_SEGMENT, in_flight=3)]
    # 100k+ elements, several segments per chunk; the last one with the default segment size
    cases += [Case(700_001, torch.float64, exact=False, segment_bytes=256 << 10),
              Case(1_048_583, torch.int32, segment_bytes=256 << 10),
              Case(300_007, torch.bfloat16, segment_bytes=64 << 10),
              Case(3_000_017, torch.int64)]
    return cases


def _input(case: Case, rank: int, seed: int) -> torch.Tensor:
    """This rank's contribution; deterministic in (case index, rank)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    m, dt = case.numel, case.dtype
    if dt == torch.bool:
        return torch.randint(0, 2, (m,), generator=g).bool()
    if case.op == "PRODUCT":   # powers of two and signs: every product is exact, no int overflow
        return torch.tensor([-2, -1, 1, 2], dtype=torch.float64)[torch.randint(0, 4, (m,), generator=g)].to(dt)
    if case.exact:
        lo, hi = (0, 256) if dt == torch.uint8 else (-8, 9)   # uint8 sums wrap, identically everywhere
        return torch.randint(lo, hi, (m,), generator=g).to(dt)
    return (torch.rand(m, generator=g, dtype=torch.float64) * 2 - 1).to(dt)


def _check_case(case: Case, seed: int, group: dist.ProcessGroup | None = None) -> list[str]:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    op = getattr(dist.ReduceOp, case.op)
    x = _input(case, rank, seed)
    ours, theirs = x.clone(), x.clone()
    returned = ring_all_reduce(ours, group, op=op, segment_bytes=case.segment_bytes, in_flight=case.in_flight)
    dist.all_reduce(theirs, op=op, group=group)
    if returned is not ours:
        return [f"{case}: did not return its input tensor"]
    if case.exact:
        if not torch.equal(ours, theirs):
            bad = (ours != theirs).nonzero().flatten()[:5].tolist()
            return [f"{case}: differs from dist.all_reduce at {bad}: {ours[bad].tolist()} vs {theirs[bad].tolist()}"]
        return []
    exact = x.double()
    dist.all_reduce(exact, group=group)
    magnitude = x.double().abs()
    dist.all_reduce(magnitude, group=group)
    bound = (n - 1) * torch.finfo(case.dtype).eps * magnitude
    errors = []
    for name, result in (("ring", ours), ("dist.all_reduce", theirs)):
        excess = (result.double() - exact).abs() - bound
        if excess.numel() and excess.max() > 0:
            i = int(excess.argmax())
            errors.append(f"{case}: {name} error {float((result.double() - exact)[i]):.3g} at {i} exceeds the "
                          f"summation bound {float(bound[i]):.3g}")
    # ring vs gloo directly: rtol 1e-6 plus twice the bound (each may be off by it, in opposite ways);
    # torch.testing is avoided on purpose: its first import costs seconds in a fresh rank
    gap = (ours.double() - theirs.double()).abs() - (1e-6 * theirs.double().abs() + 2 * bound)
    if not errors and gap.numel() and gap.max() > 0:
        i = int(gap.argmax())
        errors.append(f"{case}: ring {float(ours[i])} vs dist.all_reduce {float(theirs[i])} at {i}")
    return errors


def _check_layouts(seed: int) -> list[str]:
    """Non-contiguous views and a parameter (a leaf that requires grad) are reduced in place."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed + rank)
    base = torch.randint(-9, 10, (7, 12), generator=g)
    untouched = base[:, 1::3].clone()
    view = base[:, ::3]                                    # [7, 4], strides (12, 3): not contiguous
    expected = view.clone()
    dist.all_reduce(expected)
    ring_all_reduce(view)
    errors = [] if torch.equal(view, expected) else ["non-contiguous view: wrong result"]
    if not torch.equal(base[:, 1::3], untouched):
        errors.append("non-contiguous view: wrote outside the view")
    t = torch.randint(-9, 10, (5, 3), generator=g).float().t()    # a transposed [3, 5] float tensor
    expected_t = t.clone()
    dist.all_reduce(expected_t)
    ring_all_reduce(t)
    if not torch.equal(t, expected_t):
        errors.append("transposed tensor: wrong result")
    param = torch.nn.Parameter(torch.full((6,), float(rank + 1)))  # a leaf that requires grad
    ring_all_reduce(param)
    n = dist.get_world_size()
    if not torch.equal(param.detach(), torch.full((6,), n * (n + 1) / 2)):
        errors.append("parameter: wrong result")
    return errors


def _check_ledger(group: dist.ProcessGroup | None, name: str) -> list[str]:
    n = dist.get_world_size(group)
    ledger = CommLedger()
    comm = Comm(group, ledger, name=name)
    t = torch.arange(1001, dtype=torch.int64) + dist.get_rank(group)
    handle = comm.ring_all_reduce(t, async_op=True)
    errors = []
    if ledger.records:
        errors.append(f"{name}: recorded before wait(): {ledger.records}")
    handle.wait()
    handle.wait()                                           # idempotent: still one entry
    expected = torch.arange(1001, dtype=torch.int64) * n + n * (n - 1) // 2
    if not torch.equal(t, expected):
        errors.append(f"{name}: Comm.ring_all_reduce gave a wrong result")
    comm.ring_all_reduce(torch.ones(3, dtype=torch.bfloat16))  # synchronous: recorded at once
    got = [(r.op, r.group, r.group_size, r.nbytes, r.dtype) for r in ledger.records]
    want = [("ring_all_reduce", name, n, 1001 * 8, "int64"), ("ring_all_reduce", name, n, 3 * 2, "bfloat16")]
    if got != want:
        errors.append(f"{name}: ledger records {got}, expected {want}")
    if ledger.pending():
        errors.append(f"{name}: operations left in flight: {ledger.pending()}")
    return errors


def _check_errors() -> list[str]:
    errors = []
    for kwargs, fragment in (({"op": dist.ReduceOp.AVG}, "not supported"),
                             ({"op": dist.ReduceOp.BAND}, "integer"),
                             ({"segment_bytes": 0}, "segment_bytes")):
        try:
            ring_all_reduce(torch.ones(4), **kwargs)
            errors.append(f"{kwargs}: no error")
        except ValueError as e:
            if fragment not in str(e):
                errors.append(f"{kwargs}: unhelpful error {e}")
    return errors


def _check_subgroups() -> list[str]:
    """World 4: {0,2} and {1,3} run rings concurrently; {0} is a one-rank group (a no-op)."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    solo = dist.new_group([0])
    mine = pairs[rank % 2]
    errors = []
    for i, case in enumerate([Case(1009, torch.int64), Case(10_007, torch.int32, segment_bytes=SMALL_SEGMENT),
                              Case(4099, torch.float32, exact=False)]):
        errors += _check_case(case, seed=500 + i, group=mine)
    errors += _check_ledger(mine, name="pair")
    t = torch.arange(5.0)
    if rank == 0:
        ring_all_reduce(t, solo)
        if not torch.equal(t, torch.arange(5.0)):
            errors.append("one-rank group: not a no-op")
    else:
        try:
            ring_all_reduce(t, solo)
            errors.append("non-member: no error")
        except ValueError as e:
            if "not a member" not in str(e):
                errors.append(f"non-member: unhelpful error {e}")
    return errors


def _check_background_thread() -> list[str]:
    """A ring on a communication thread while the main thread runs another ring on another group."""
    everyone = list(range(dist.get_world_size()))
    side, main = dist.new_group(everyone), dist.new_group(everyone)
    results: dict[str, list[str]] = {}

    def work() -> None:
        try:
            results["thread"] = _check_case(Case(200_003, torch.int64, segment_bytes=SMALL_SEGMENT * 16), 700, side)
        except Exception:  # noqa: BLE001 - reported as a failure of this rank
            results["thread"] = [f"background ring raised:\n{traceback.format_exc()}"]

    thread = threading.Thread(target=work)
    thread.start()
    errors = _check_case(Case(150_001, torch.int32, segment_bytes=SMALL_SEGMENT * 16), 701, main)
    thread.join(timeout=60)
    if thread.is_alive():
        return errors + ["background ring did not finish"]
    return errors + results.get("thread", ["background ring raised"])


def _check_world(full: bool) -> list[str]:
    torch.set_num_threads(1)
    n = dist.get_world_size()
    errors: list[str] = []
    for i, case in enumerate(_cases(n, full=full)):
        errors += _check_case(case, seed=i)
    errors += _check_layouts(seed=99)
    errors += _check_ledger(None, name="world")
    if full:
        errors += _check_errors()
    if full and n == 4:
        errors += _check_subgroups()
        errors += _check_background_thread()
    return errors


@pytest.mark.parametrize("world_size,full", [(2, True), (3, True), (4, True),
                                             pytest.param(8, False, marks=pytest.mark.slow)])
def test_ring_all_reduce_matches_gloo(world_size: int, full: bool) -> None:
    per_rank = run_distributed(_check_world, world_size, args=(full,), timeout=240)
    failures = [f"rank {r}: {msg}" for r, errors in enumerate(per_rank) for msg in errors]
    assert not failures, "\n".join(failures[:40])


# -- pure index arithmetic (no processes) -----------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 500), size=st.integers(1, 9), segment=st.integers(1, 40))
def test_plan_partitions_the_tensor(numel: int, size: int, segment: int) -> None:
    plan = RingPlan(numel, size, segment)
    lengths = [plan.chunk_bounds(c)[1] for c in range(size)]
    assert max(lengths) - min(lengths) <= 1
    covered = []
    for c in range(size):
        start, length = plan.chunk_bounds(c)
        pieces = [plan.segment_bounds(c, s) for s in range(plan.num_segments)]
        assert all(0 <= n <= segment for _, n in pieces)
        assert sum(n for _, n in pieces) == length
        covered += [i for s, n in pieces for i in range(s, s + n)]
    assert covered == list(range(numel))


@settings(max_examples=100, deadline=None)
@given(numel=st.integers(0, 60), size=st.integers(1, 8))
def test_plan_schedule_reduces_on_a_simulated_ring(numel: int, size: int) -> None:
    """Run the schedule on lists: every rank ends with the elementwise sum of all inputs."""
    plan = RingPlan(numel, size, 1)
    data = [[(r + 1) * 100 + i for i in range(numel)] for r in range(size)]
    expected = [sum(col) for col in zip(*data)] if numel else []
    for step in range(plan.num_steps):
        sent = {}
        for r in range(size):
            start, length = plan.chunk_bounds(plan.send_chunk(r, step))
            sent[(r + 1) % size] = data[r][start:start + length]
            if step + 1 < plan.num_steps:       # the pipelining rule: send next what was received now
                assert plan.send_chunk(r, step + 1) == plan.recv_chunk(r, step)
        for r in range(size):
            start, length = plan.chunk_bounds(plan.recv_chunk(r, step))
            assert plan.send_chunk((r - 1) % size, step) == plan.recv_chunk(r, step)
            incoming = sent[r]
            if plan.is_reduce_step(step):
                data[r][start:start + length] = [a + b for a, b in zip(data[r][start:start + length], incoming)]
            else:
                data[r][start:start + length] = incoming
    assert all(d == expected for d in data)


def test_plan_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="segment_numel"):
        RingPlan(10, 2, 0)
