"""Parameters whose copies sit on fewer ranks than the data-parallel group.

Data parallelism assumes every dp rank holds the same copy of every parameter, so gradients are averaged over
dp. An expert under expert parallelism is held only by the dp / ep ranks of one expert coordinate (its
*expert-data-parallel* group): its gradient is summed over that group alone, and still divided by the dp size
(its rows came from the tokens of every dp rank, through the all-to-all, and the loss is a mean over all of them).

The layer that creates such a parameter marks it with its `ReplicaGroup` (the group is passed to the layer,
never looked up); the data-parallel strategies read the mark when they lay out their buckets, so the engine
never asks whether a model has experts. DeepSpeed marks the same parameters with `allreduce = False` and a
`group_name`; `mark_replicas` sets those too, so DeepSpeed's `is_moe_param` and param-group splitting see them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence, TypeVar

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger

REPLICA_GROUP_ATTR = "shardwise_replica_group"


@dataclass(frozen=True, eq=False)
class ReplicaGroup:
    """The ranks holding equal copies of the marked parameters (a subgroup of the dp group)."""

    group: dist.ProcessGroup
    name: str
    """DeepSpeed's group name ("ep_size_2"), also the ledger's name of the group."""

    def comm(self, ledger: CommLedger) -> Comm:
        return Comm(self.group, ledger, name=self.name)


def mark_replicas(params: Iterable[torch.nn.Parameter], replicas: ReplicaGroup) -> None:
    for p in params:
        setattr(p, REPLICA_GROUP_ATTR, replicas)
        # DeepSpeed's marks of an expert parameter (attributes past nn.Parameter's own)
        p.allreduce = False                 # type: ignore[attr-defined]
        p.group_name = replicas.name        # type: ignore[attr-defined]


def replicas_of(p: torch.Tensor) -> ReplicaGroup | None:
    """The parameter's own replica group, or None: it is replicated over the whole dp group."""
    return getattr(p, REPLICA_GROUP_ATTR, None)


_T = TypeVar("_T", bound=torch.Tensor)


def split_by_replicas(params: Sequence[_T]) -> list[tuple[ReplicaGroup | None, list[_T]]]:
    """`params` partitioned by replica group, each part in the given order; the parts in first-seen order."""
    parts: dict[int, tuple[ReplicaGroup | None, list[_T]]] = {}
    for p in params:
        group = replicas_of(p)
        parts.setdefault(id(group), (group, []))[1].append(p)
    return list(parts.values())


class ReplicaComms:
    """One `Comm` per replica group met, recording into the dp group's ledger; `of(p)` is None for parameters the
    whole dp group holds (the caller's dp `Comm` serves them)."""

    def __init__(self, ledger: CommLedger) -> None:
        self.ledger = ledger
        self._comms: dict[int, Comm] = {}

    def of(self, group: ReplicaGroup | None) -> Comm | None:
        if group is None:
            return None
        if id(group) not in self._comms:
            self._comms[id(group)] = group.comm(self.ledger)
        return self._comms[id(group)]


def broadcast_replicas(tensors: Sequence[torch.Tensor], world: Comm) -> None:
    """Make every rank start from the same values: tensors without a replica group from `world`'s rank 0, the
    others from the first rank of their own group (each expert's copies agree; other experts differ)."""
    comms = ReplicaComms(world.ledger)
    for group, part in split_by_replicas(tensors):
        comm = comms.of(group)
        (world if comm is None else comm).broadcast_coalesced(part)
