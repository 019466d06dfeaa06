"""The per-step desync check: did every rank run the same collectives? And the stop vote that rides in it.

Collectives pair by order, not by meaning: a rank that called backward without step, or ran one step fewer,
pairs its collectives with another step's on the other ranks, trains on (silently wrong), and hangs only at the
end. So the engine opens every training step with `SequenceCheck.launch(step)`, and the error replaces the hang.
"""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardwise.comm.abort import is_gloo_check
from shardwise.comm.collectives import Comm, Handle
from shardwise.comm.ledger import CommLedger
from shardwise.errors import DesyncError

TRAIN_STEP = 0
"""`verify` kinds: the start of a training step, or the end of training (`Engine.destroy`)."""
END = 1
_NONE = -(2 ** 40)
_HALF = 31
_instances = itertools.count()


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


class SequenceCheck:
    """One all-reduce (MAX) over the world per step comparing every rank's `CommLedger.fingerprint` (a running hash
    of every group's (op, dtype, shape) sequence), per pipeline stage: stages are compared apart because their
    programs differ (sends versus receives, the loss on the last). The same all-reduce carries the stop vote
    (`agree_stop`): the largest signal any rank was asked to stop by.

    It runs on the guards' own communicator (`ParallelMesh.guard_comm`: gloo, host tensors), so it pairs only with
    the other ranks' checks, never with a gradient bucket, and needs no device synchronisation. It is launched as
    the step opens (`launch`, asynchronous: gloo's thread carries it while the host goes on) and judged before this
    rank's next collective on any other group (`CommLedger.before_op`), so when the ranks drifted by whole steps
    the drifted collective never runs: every rank posts what it ran since the last check to the store (a side
    channel) and raises `DesyncError` naming the first differing operation and the ranks on each side. Cost:
    8 * (5 + 4P) bytes per step on the host and no read of the device. With the check turned off
    (`communication.desync_check: false`) nothing runs per step; the stop vote is then a one-value all-reduce of
    its own, on the same communicator.
    """

    def __init__(self, ledger: CommLedger, comm: Comm, *, stage: int, stages: int, store: Any, wait_s: float,
                 enabled: bool = True):
        self.ledger = ledger
        self.comm = comm
        self.stage, self.stages = stage, stages
        self.store = store
        self.wait_s = wait_s
        self.enabled = enabled
        self.prefix = f"shardwise/desync/{next(_instances)}"
        self._count = 0
        self._lock = threading.Lock()
        """Held while judging: a collective launched on another thread meanwhile waits for the verdict."""
        self._state_lock = threading.Lock()
        """Guards `_intervals` and `_count` for `state` (the watchdog's thread), never held while waiting."""
        self.pending: Handle | None = None
        """The launched check's all-reduce, not yet judged."""
        self._values: np.ndarray = np.zeros(0, dtype=np.int64)
        """int64 [5 + 4P], a view of the check's host tensor: the MAX-reduced values once `pending` completes."""
        self._launched: tuple[int, int, int, dict[str, list[str]]] = (0, TRAIN_STEP, 0, {})
        self._intervals: dict[int, dict[str, list[str]]] = {}
        """Launch number n -> the operations between launches n - 1 and n (the last two kept, for hang reports)."""
        self._failed: DesyncError | None = None
        self._stop_mine = 0
        self._stop_agreed = 0

    @classmethod
    def build(cls, ledger: CommLedger, comm: Comm, *, stage: int, stages: int, wait_s: float,
              enabled: bool = True) -> "SequenceCheck | None":
        """None in a world of one. `comm`: the guards' own communicator over every rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        store = dist.distributed_c10d._get_default_store()
        check = cls(ledger, comm, stage=stage, stages=stages, store=store, wait_s=wait_s, enabled=enabled)
        check._explain_failures()
        ledger.before_op = check._before_op
        ledger.guard_groups.add(comm.name)
        ledger.sequence_state = check.state
        return check

    def _explain_failures(self) -> None:
        """A collective that fails while a check is pending (a peer that found the desync left) is judged by the
        check first: its result arrived before the failure, and names the cause rather than the symptom."""
        earlier = self.ledger.explain

        def explain(error: BaseException) -> BaseException:
            if self.pending is not None:
                try:
                    self.settle()
                except DesyncError as desync:
                    return desync
                except RuntimeError:          # the check's own all-reduce failed too
                    pass
            return earlier(error) if earlier is not None else error

        self.ledger.explain = explain

    def _before_op(self, group: str) -> None:
        """Before any other collective of this rank (on whichever thread launches it): judge the pending check."""
        if self._failed is not None:
            raise self._failed
        if group != self.comm.name and self.pending is not None:
            self.settle()

    def verify(self, step: int, kind: int = TRAIN_STEP) -> None:
        """Collective over the world: raise `DesyncError` on every rank unless all ran the same operations."""
        if not self.enabled:
            return
        self.launch(step, kind)
        self.settle()

    def launch(self, step: int, kind: int = TRAIN_STEP) -> None:
        """Start this step's check (after judging a previous one nobody read); its result waits in `pending`.

        The values are int64 [kind, -kind, step, -step, then for each stage s hi_s, -hi_s, lo_s, -lo_s, then
        the stop signal], where hi_s/lo_s are the halves of the fingerprint posted by the ranks of stage s (the
        others post the smallest value). max(x) == -max(-x) on every pair iff all ranks agree.
        """
        self.settle()
        if not self.enabled:
            return
        fingerprint = self.ledger.fingerprint()
        hi, lo = fingerprint >> _HALF, fingerprint & ((1 << _HALF) - 1)
        values = [kind, -kind, step, -step] + [_NONE] * (4 * self.stages) + [self._stop_mine]
        values[4 + 4 * self.stage: 8 + 4 * self.stage] = [hi, -hi, lo, -lo]
        self._values = np.array(values, dtype=np.int64)
        # A host tensor sharing the array's memory: gloo writes the result there, and it is read through the
        # array (host memory: no device read is involved).
        self.pending = self.comm.all_reduce(torch.from_numpy(self._values), op=dist.ReduceOp.MAX, async_op=True)
        taken = self.ledger.take_sequence()     # since the last launch, this check's own all-reduce included
        self._launched = (step, kind, fingerprint, taken)
        with self._state_lock:
            self._count += 1
            self._intervals[self._count] = taken
            self._intervals.pop(self._count - 2, None)

    def settle(self) -> None:
        """Judge the pending check (waiting for its all-reduce, normally long done); collective only in that the
        other ranks must have launched theirs."""
        with self._lock:
            if self._failed is not None:
                raise self._failed
            handle = self.pending
            if handle is None:
                return
            self.pending = None
            handle.wait()
            values = self._values.tolist()
            self._stop_agreed = int(values[-1])
            pairs = list(zip(values[0:-1:2], values[1:-1:2]))
            if all(high == -low for high, low in pairs):
                return
            step, kind, fingerprint, ops = self._launched
            self._failed = DesyncError(self._diagnose(step, kind, fingerprint, ops, [int(v) for v in values[:4]]))
            raise self._failed

    def agree_stop(self, signum: int) -> int:
        """The stop vote, the same answer on every rank: the largest signal number any rank was asked to stop by
        (0: none). Call it at the same point of every step (after `engine.step()`). With the check on, `signum`
        rides in the next step's check and the answer is the one the last judged check carried (no collective
        here: a signal is acted on one step later); otherwise one all-reduce of its own."""
        self._stop_mine = max(self._stop_mine, int(signum))
        if not self.enabled:
            flag = torch.tensor([float(self._stop_mine)])
            self.comm.all_reduce(flag, op=dist.ReduceOp.MAX)
            return int(np.asarray(flag)[0])      # a host tensor: no device read
        self.settle()
        return self._stop_agreed

    def state(self) -> dict[str, Any]:
        """For a hang report (any thread): the number of checks launched, the operations of the last two intervals
        between launches and those since the last launch, so the reports of ranks one check apart can be compared
        from the launch all of them made (`desync_in_reports`)."""
        with self._state_lock:
            launched, intervals = self._count, dict(self._intervals)
        return {"stage": self.stage, "launched": launched, "intervals": {str(n): ops for n, ops in intervals.items()},
                "since": self.ledger.peek_sequence()}

    def _diagnose(self, step: int, kind: int, fingerprint: int, ops: dict[str, list[str]],
                  agreed: list[int]) -> str:
        """Every rank's post (through the store) -> the one line every rank raises. `agreed`: the check's
        [max kind, -min kind, max step, -min step]."""
        world = dist.get_world_size()
        key = f"{self.prefix}/{self._count}"
        mine = {"kind": kind, "step": step, "stage": self.stage, "fp": fingerprint, "ops": ops}
        self.store.set(f"{key}/{dist.get_rank()}", json.dumps(mine))
        # A rank that ended (engine.destroy) while others train: they read their check only when a collective
        # with it fails, i.e. after it leaves, so it does not wait for their posts long.
        wait_s = self.wait_s if agreed[0] == -agreed[1] else min(self.wait_s, 5.0)
        try:
            self.store.wait([f"{key}/{r}" for r in range(world)], _timedelta(wait_s))
        except RuntimeError:
            pass
        posts = {}
        for r in range(world):
            if self.store.check([f"{key}/{r}"]):
                posts[r] = json.loads(self.store.get(f"{key}/{r}"))
        apart = agreed[0] != -agreed[1] or agreed[2] != -agreed[3]
        return describe_desync(posts, world, steps=(-agreed[3], agreed[2]) if apart else None)


def _timedelta(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)


def describe_desync(posts: dict[int, dict[str, Any]], world: int, steps: tuple[int, int] | None = None) -> str:
    """The error line from every rank's post ({kind, step, stage, fp, ops}; a rank missing did not post).
    `steps`: the lowest and highest step the check saw when the ranks were at different steps or one had ended
    (None: all at one step), which the ranks that did not post cannot tell."""
    by_state: dict[tuple[int, int], list[int]] = {}
    for r, p in sorted(posts.items()):
        by_state.setdefault((p["kind"], p["step"]), []).append(r)
    fix = ("every rank must run the same loop: the same number of train_batch / forward-backward-step calls, and "
           "engine.step() after every engine.backward()")
    if len(by_state) > 1 or steps is not None:
        parts = [f"rank(s) {_ranks(ranks)} " + (f"start step {step}" if kind == TRAIN_STEP
                                                  else f"ended training after step {step} (engine.destroy)")
                 for (kind, step), ranks in sorted(by_state.items(), key=lambda item: item[1][0])]
        missing = [r for r in range(world) if r not in posts]
        if missing:
            seen = f" (the check saw steps {steps[0]} to {steps[1]})" if steps is not None else ""
            seen = seen.replace(f"steps {steps[0]} to {steps[0]}", f"step {steps[0]}") if steps else seen
            parts.append(f"rank(s) {_ranks(missing)} did not report{seen}: inside a collective with a rank "
                         f"that left")
        return f"desync: the ranks are at different steps: {'; '.join(parts)}; {fix}"
    (_, step), = by_state
    for stage in sorted({p["stage"] for p in posts.values()}):
        members = {r: p for r, p in posts.items() if p["stage"] == stage}
        if len({p["fp"] for p in members.values()}) > 1:
            return f"desync at step {step}: {_first_difference(members)}; {fix}"
    missing = [r for r in range(world) if r not in posts]
    return f"desync at step {step}: the ranks' collectives differ (rank(s) {_ranks(missing)} did not post theirs)"


def _first_difference(members: dict[int, dict[str, Any]]) -> str:
    """The first operation, group by group, where the members' sequences since the last check part."""
    groups = sorted({g for p in members.values() for g in p["ops"]})
    for group in groups:
        seqs = {r: p["ops"].get(group, []) for r, p in members.items()}
        for i in range(max(len(s) for s in seqs.values())):
            seen: dict[str, list[int]] = {}
            for r, s in seqs.items():
                seen.setdefault(s[i] if i < len(s) else "nothing", []).append(r)
            if len(seen) > 1:
                sides = "; ".join(f"rank(s) {_ranks(ranks)} ran {what}" for what, ranks in seen.items())
                return f'operation {i + 1} on "{group}" since the last check differs: {sides}'
    return "the ranks' collectives differ before the last check"


def desync_in_reports(reports: dict[int, dict[str, Any] | None]) -> str | None:
    """The desync line a hang turns out to be, from the hang watchdog's reports (see `HangWatchdog._report`:
    `op`, `group`, `seq`, `signature` of the operation a rank waits on, `counts` of operations per group, `seq_state`
    from `SequenceCheck.state`), or None when it is no desync (a rank absent, or outside any collective: a stall).

    Three findings, the first that applies:
    - operation i of a group since the check the ranks last agreed on differs in kind or shape between ranks (the
      mismatch NCCL would run silently or hang in);
    - a rank's process is aborting on gloo's failed check (`comm.abort`) while the others wait in collectives:
      its collective met one of another size (it may be one shardwise did not launch, which no ledger shows);
    - every rank waits in a collective, but not all in the same one: each waits for ranks that are themselves waiting
      elsewhere, which only a different order of collectives causes (an extra or a missing collective).
    """
    present = {r: rep for r, rep in reports.items() if rep is not None}
    if len(present) < 2 or len(present) < len(reports):
        return None
    fix = ("every rank must run the same collectives in the same order: look for a collective that only some ranks "
           "make (a rank-dependent branch, an extra or missing step)")
    steps = sorted({rep["step"] for rep in present.values()})
    at = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
    aligned = _aligned_since_agreed(present)
    for stage in sorted({ops_stage for ops_stage, _ in aligned.values()}):
        members = {r: {"ops": ops} for r, (s, ops) in aligned.items() if s == stage}
        line = _first_content_difference(members)
        if line is not None:
            return f"desync at {at}: {line}; {fix}"
    failed = [r for r, rep in sorted(present.items()) if is_gloo_check(rep.get("aborted"))]
    if failed and all(rep.get("op") for r, rep in present.items() if r not in failed):
        inside = [_where(present[r]) for r in failed if present[r].get("op")]
        parts = [f"rank(s) {_ranks(failed)} failed gloo's message-size check in "
                 + (" / ".join(inside) if len(inside) == len(failed)
                    else "a collective shardwise did not launch (torch.distributed called directly?)")]
        parts += [f"rank {r} waits in {_where(rep)}" for r, rep in sorted(present.items()) if r not in failed]
        return f"desync at {at}: {'; '.join(parts)}; {fix}"
    if not all(rep.get("op") for rep in present.values()):
        return None
    waits: dict[tuple[str, int], list[int]] = {}
    for r, rep in sorted(present.items()):
        waits.setdefault((rep["group"], rep["seq"]), []).append(r)
    if len(waits) < 2:
        return None
    parts = []
    for (group, seq), ranks in waits.items():
        rep = present[ranks[0]]
        what = f'{rep["op"]} {rep.get("signature", "")}'.strip()
        short = sorted(r for r, other in present.items() if other.get("counts", {}).get(group, 0) < seq)
        behind = f", which rank(s) {_ranks(short)} did not launch" if short else ""
        parts.append(f'rank(s) {_ranks(ranks)} wait in {what} on "{group}" #{seq}{behind}')
    return f"desync at {at}: the ranks wait in collectives that cannot pair: " \
           f"{'; '.join(parts)}; {fix}"


def _where(rep: dict[str, Any]) -> str:
    """'all_reduce float32[3] on "dp" #5': the operation a report waits in."""
    what = f'{rep["op"]} {rep.get("signature", "")}'.strip()
    return f'{what} on "{rep["group"]}" #{rep["seq"]}'


def _aligned_since_agreed(reports: dict[int, dict[str, Any]]) -> dict[int, tuple[int, dict[str, list[str]]]]:
    """rank -> (stage, operations per group since the launch of check n - 1), n the fewest checks any rank
    launched: every rank launched check n - 1, and the ones that launched n + 1 already saw n agree."""
    states = {r: rep.get("seq_state") or {} for r, rep in reports.items()}
    fewest = min(int(st.get("launched", 0)) for st in states.values())
    out = {}
    for r, st in states.items():
        ops: dict[str, list[str]] = {}
        intervals = st.get("intervals", {})
        for n in range(max(fewest, 1), int(st.get("launched", 0)) + 1):
            if str(n) not in intervals:
                break
            for group, seq in intervals[str(n)].items():
                ops.setdefault(group, []).extend(seq)
        else:
            for group, seq in st.get("since", {}).items():
                ops.setdefault(group, []).extend(seq)
            out[r] = (int(st.get("stage", 0)), ops)
    return out


def _first_content_difference(members: dict[int, dict[str, Any]]) -> str | None:
    """Like `_first_difference`, but only where two ranks both ran an operation at the same place and it differs
    (a rank that ran fewer may just not have got there yet)."""
    groups = sorted({g for p in members.values() for g in p["ops"]})
    for group in groups:
        seqs = {r: p["ops"].get(group, []) for r, p in members.items()}
        for i in range(min(len(s) for s in seqs.values())):
            seen: dict[str, list[int]] = {}
            for r, s in seqs.items():
                seen.setdefault(s[i], []).append(r)
            if len(seen) > 1:
                sides = "; ".join(f"rank(s) {_ranks(ranks)} ran {what}" for what, ranks in seen.items())
                return f'operation {i + 1} on "{group}" since the last check differs: {sides}'
    return None
