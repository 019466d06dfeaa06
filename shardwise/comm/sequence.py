"""The per-step desync check: did every rank run the same collectives?

Collectives pair by order, not by meaning: a rank that called backward without step, or ran one step fewer,
pairs its collectives with another step's on the other ranks, trains on (silently wrong), and hangs only at the
end. So the engine opens every training step with `SequenceCheck.launch(step)`, and the error replaces the hang.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm
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
    programs differ (sends versus receives, the loss on the last).

    The check's own all-reduce always pairs with the other ranks' check when the ranks drifted by whole steps (it
    is the first collective of a step). When they disagree, every rank posts what it ran since the last check to
    the store (a side channel, not the communicators) and raises `DesyncError` naming the first differing
    operation and the ranks on each side. Cost: 8 * (6 + 4P) bytes per step, and no host read of its own on the
    engine's path: the all-reduce is launched as the step opens (`launch`, on the device when the group has no CPU
    backend) and its result is read in the step's one host read, beside the verdict (`ExtraSums.agreed`;
    [Note: one host read per step]); `settle` then judges it. A check the step did not read (a pipeline's global
    batch, the end of training) is read by itself when the next one opens.
    """

    def __init__(self, ledger: CommLedger, *, stage: int, stages: int, store: Any, wait_s: float):
        self.ledger = ledger
        self.comm = Comm(None, ledger, name="world:check")
        self.stage, self.stages = stage, stages
        self.store = store
        self.wait_s = wait_s
        self.prefix = f"shardwise/desync/{next(_instances)}"
        self._count = 0
        self.pending: torch.Tensor | None = None
        """int64 [4 + 4P]: the launched check's MAX-reduced values, not yet judged."""
        self._launched: tuple[int, int, int, dict[str, list[str]]] = (0, TRAIN_STEP, 0, {})

    @classmethod
    def build(cls, ledger: CommLedger, *, stage: int, stages: int, wait_s: float) -> "SequenceCheck | None":
        """None in a world of one."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        store = dist.distributed_c10d._get_default_store()
        check = cls(ledger, stage=stage, stages=stages, store=store, wait_s=wait_s)
        check._explain_failures()
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
            return earlier(error) if earlier is not None else error

        self.ledger.explain = explain

    def verify(self, step: int, kind: int = TRAIN_STEP) -> None:
        """Collective over the world: raise `DesyncError` on every rank unless all ran the same operations."""
        self.launch(step, kind)
        self.settle()

    def launch(self, step: int, kind: int = TRAIN_STEP) -> None:
        """Start this step's check (after judging a previous one nobody read); its result waits in `pending`.

        The values are int64 [kind, -kind, step, -step, then for each stage s hi_s, -hi_s, lo_s, -lo_s], where
        hi_s/lo_s are the halves of the fingerprint posted by the ranks of stage s (the others post the smallest
        value). max(x) == -max(-x) on every pair iff all ranks agree. Every value stays below 2**53 (the hash goes
        as two 31-bit halves) so that it survives the step's float64 host read.
        """
        self.settle()
        self._count += 1
        fingerprint = self.ledger.fingerprint()
        hi, lo = fingerprint >> _HALF, fingerprint & ((1 << _HALF) - 1)
        values = [kind, -kind, step, -step] + [_NONE] * (4 * self.stages)
        values[4 + 4 * self.stage: 8 + 4 * self.stage] = [hi, -hi, lo, -lo]
        on_host = self.comm.carries_host_tensors
        device = torch.device("cpu") if on_host else torch.device("cuda", torch.cuda.current_device())
        agreed = torch.tensor(values, dtype=torch.int64, device=device)
        self.comm.all_reduce(agreed, op=dist.ReduceOp.MAX)
        self.pending = agreed
        self._launched = (step, kind, fingerprint, self.ledger.take_sequence())

    def settle(self, values: list[float] | None = None) -> None:
        """Judge the pending check: from `values` (its result, read with the step's verdict) or read it now."""
        if self.pending is None:
            return
        if values is None:
            values = self.pending.tolist()
        self.pending = None
        step, kind, fingerprint, ops = self._launched
        pairs = list(zip(values[0::2], values[1::2]))
        if all(high == -low for high, low in pairs):
            return
        raise DesyncError(self._diagnose(step, kind, fingerprint, ops, [int(v) for v in values[:4]]))

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
