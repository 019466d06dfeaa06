"""Where each ZeRO-3 parameter lives, recorded on the parameter, so a script holding only a parameter can gather
it (`shardwise.zero.GatheredParameters`, DeepSpeed's `param.ds_*` attributes play this part there).

A parameter's home names its unit and flat (None for a persistent parameter, whole on every rank), the dp `Comm`
of its shards, and the keeper that gathers and frees units: the stage-3 runtime once `initialize` built it
(its live-element count stays right), else a `UnitKeeper` for a model materialized before `initialize`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shardwise.comm.collectives import Comm
from shardwise.parallel.zero.flat import FlatShard
from shardwise.parallel.zero.params import Partition, Unit

HOME_ATTR = "_shardwise_zero3_home"


class Keeper(Protocol):
    def gather_unit(self, u: Unit) -> None: ...

    def free_unit(self, u: Unit) -> None: ...


@dataclass(eq=False)
class ParamHome:
    keeper: Keeper
    comm: Comm
    unit: Unit | None           # None: a persistent parameter (whole on every rank)
    flat: FlatShard | None
    index: int                  # the parameter's index in `flat`


class UnitKeeper:
    """Gathers and frees units of a model no runtime drives yet (after `materialize_sharded`)."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def gather_unit(self, u: Unit) -> None:
        u.gather(self.comm)

    def free_unit(self, u: Unit) -> None:
        u.free()


def mark_homes(partition: Partition, keeper: Keeper, comm: Comm) -> None:
    """Record every parameter's home (again after `initialize` re-keyed the flats)."""
    for u in partition.units:
        for f in u.flats:
            for i, p in enumerate(f.params):
                setattr(p, HOME_ATTR, ParamHome(keeper, comm, u, f, i))
    for p in partition.persistent:
        setattr(p, HOME_ATTR, ParamHome(keeper, comm, None, None, -1))
