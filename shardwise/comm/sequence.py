"""The per-step desync check: did every rank run the same collectives?

Collectives pair by order, not by meaning: a rank that called backward without step, or ran one step fewer,
pairs its collectives with another step's on the other ranks, trains on (silently wrong), and hangs only at the
end. So at the start of every training step the engine calls `verify(step)`: one all-reduce (MAX) over the world
of int64 [kind, -kind, step, -step, h_0, -h_0, ..., h_{P-1}, -h_{P-1}], where h_s is the ledger's fingerprint
(`CommLedger.fingerprint`: a running hash of every group's (op, dtype, shape) sequence) posted by the ranks of
pipeline stage s (the others post the smallest value). max(x) == -max(-x) on every pair iff all ranks agree;
stages are compared apart because their programs differ (sends versus receives, the loss on the last).

The check's own all-reduce always pairs with the other ranks' check when the ranks drifted by whole steps (it is
the first collective of a step), so the error replaces the hang. When they disagree, every rank posts what it
ran since the last check to the store (a side channel, not the communicators) and raises `DesyncError` naming
the first differing operation and the ranks on each side. Cost: 8 * (4 + 2P) bytes and one host sync per step.
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
_NONE = -(2 ** 62)
_instances = itertools.count()


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


class SequenceCheck:
    def __init__(self, ledger: CommLedger, *, stage: int, stages: int, store: Any, wait_s: float):
        self.ledger = ledger
        self.comm = Comm(None, ledger, name="world:check")
        self.stage, self.stages = stage, stages
        self.store = store
        self.wait_s = wait_s
        self.prefix = f"shardwise/desync/{next(_instances)}"
        self._count = 0

    @classmethod
    def build(cls, ledger: CommLedger, *, stage: int, stages: int, wait_s: float) -> "SequenceCheck | None":
        """None in a world of one."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        store = dist.distributed_c10d._get_default_store()
        return cls(ledger, stage=stage, stages=stages, store=store, wait_s=wait_s)

    def verify(self, step: int, kind: int = TRAIN_STEP) -> None:
        """Collective over the world: raise `DesyncError` on every rank unless all ran the same operations."""
        self._count += 1
        fingerprint = self.ledger.fingerprint()
        values = [kind, -kind, step, -step] + [_NONE] * (2 * self.stages)
        values[4 + 2 * self.stage: 6 + 2 * self.stage] = [fingerprint, -fingerprint]
        agreed = torch.tensor(values, dtype=torch.int64)
        self.comm.all_reduce(agreed, op=dist.ReduceOp.MAX)
        pairs = agreed.view(-1, 2).tolist()
        ops = self.ledger.take_sequence()
        if all(high == -low for high, low in pairs):
            return
        raise DesyncError(self._diagnose(step, kind, fingerprint, ops))

    def _diagnose(self, step: int, kind: int, fingerprint: int, ops: dict[str, list[str]]) -> str:
        """Every rank's post (through the store) -> the one line every rank raises."""
        world = dist.get_world_size()
        key = f"{self.prefix}/{self._count}"
        mine = {"kind": kind, "step": step, "stage": self.stage, "fp": fingerprint, "ops": ops}
        self.store.set(f"{key}/{dist.get_rank()}", json.dumps(mine))
        try:
            self.store.wait([f"{key}/{r}" for r in range(world)], _timedelta(self.wait_s))
        except RuntimeError:
            pass
        posts = {}
        for r in range(world):
            if self.store.check([f"{key}/{r}"]):
                posts[r] = json.loads(self.store.get(f"{key}/{r}"))
        return describe_desync(posts, world)


def _timedelta(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)


def describe_desync(posts: dict[int, dict[str, Any]], world: int) -> str:
    """The error line from every rank's post ({kind, step, stage, fp, ops}; a rank missing did not post)."""
    by_state: dict[tuple[int, int], list[int]] = {}
    for r, p in sorted(posts.items()):
        by_state.setdefault((p["kind"], p["step"]), []).append(r)
    fix = ("every rank must run the same loop: the same number of train_batch / forward-backward-step calls, and "
           "engine.step() after every engine.backward()")
    if len(by_state) > 1:
        parts = [f"rank(s) {_ranks(ranks)} " + (f"start step {step}" if kind == TRAIN_STEP
                                                  else f"ended training after step {step} (engine.destroy)")
                 for (kind, step), ranks in sorted(by_state.items(), key=lambda item: item[1][0])]
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
