"""DeepSpeed's `zero.GatheredParameters` (`shardwise.zero.GatheredParameters`): ZeRO-3 parameters whole inside a
block, and the record on each ZeRO-3 parameter that lets a script holding only the parameter gather it (DeepSpeed's
`param.ds_*` attributes play this part there)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import torch

from shardwise.comm.collectives import Comm
from shardwise.errors import UserError
from shardwise.parallel.zero.flat import FlatShard
from shardwise.parallel.zero.params import Partition, Unit
from shardwise.parallel.zero.states import PARAM_STATUS, GatherState, ZeroParamStatus

LOCATION_ATTR = "_shardwise_zero3_location"
"""Attribute of every parameter of a ZeRO-3 model: its `ParamLocation`."""


class UnitGatherer(Protocol):
    """Who gathers and frees a model's units: the stage-3 runtime once `initialize` built it (its count of live
    elements stays right), else a `StandaloneGatherer`."""

    def gather_unit(self, u: Unit) -> None: ...

    def free_unit(self, u: Unit) -> None: ...


@dataclass(eq=False)
class ParamLocation:
    """Where one ZeRO-3 parameter lives: its unit and flat (None for a persistent parameter, whole on every rank),
    its index in the flat, the dp `Comm` of its shards and who gathers its unit."""

    gatherer: UnitGatherer
    comm: Comm
    unit: Unit | None
    flat: FlatShard | None
    index: int


class StandaloneGatherer:
    """Gathers and frees units of a model no runtime drives yet (built by `zero.Init`, before `initialize`)."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def gather_unit(self, u: Unit) -> None:
        u.gather(self.comm)

    def free_unit(self, u: Unit) -> None:
        u.free()


_next_ds_id = itertools.count()


def record_locations(partition: Partition, gatherer: UnitGatherer, comm: Comm) -> None:
    """Record every parameter's location (again after `initialize` re-keyed the flats and built the runtime), and
    DeepSpeed's public `ds_*` attributes for scripts that read them:

        ds_id       int                a number per parameter, kept across re-recordings
        ds_numel    int                the whole parameter's element count (its .numel() is 0 while sharded)
        ds_shape    torch.Size         the whole parameter's shape
        ds_tensor   [k] tensor         this rank's piece of it (a view of the unit's shard; k is this rank's share
                                       of its flat, not DeepSpeed's ceil(numel / dp)); the whole value if persistent
        ds_persist  bool               kept whole on every rank (persistence threshold)
        ds_status   ZeroParamStatus    follows the unit's gather state (`Unit.marks_status`)"""
    for u in partition.units:
        u.marks_status = True
        status = PARAM_STATUS[u.gather_state]
        for f in u.flats:
            pieces = f.local_views(f.shard)
            for i, p in enumerate(f.params):
                setattr(p, LOCATION_ATTR, ParamLocation(gatherer, comm, u, f, i))
                _mark(p, numel=f.layout.sizes[i], shape=torch.Size(f.shapes[i]), piece=pieces[i].view(-1),
                      persist=False, status=status)
    for p in partition.persistent:
        setattr(p, LOCATION_ATTR, ParamLocation(gatherer, comm, None, None, -1))
        _mark(p, numel=p.numel(), shape=p.shape, piece=p.data, persist=True, status=ZeroParamStatus.AVAILABLE)


def _mark(p: torch.Tensor, *, numel: int, shape: torch.Size, piece: torch.Tensor, persist: bool,
          status: ZeroParamStatus) -> None:
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_next_ds_id)  # type: ignore[attr-defined]
    p.ds_numel, p.ds_shape, p.ds_tensor = numel, shape, piece  # type: ignore[attr-defined]
    p.ds_persist, p.ds_status = persist, status  # type: ignore[attr-defined]


class GatheredParameters:
    """DeepSpeed's semantics:

        with GatheredParameters(params):                     # read: every rank sees the whole values
        with GatheredParameters(params, modifier_rank=0):    # modify on rank 0: on exit its values are
                                                              # broadcast and cut back into every rank's shards

    Collective over the parameters' data-parallel group: every rank enters with the same parameters. Parameters
    that are not ZeRO-3 shards (other stages, plain modules) are left alone, so the block is a no-op outside
    ZeRO-3, as in DeepSpeed. A unit already gathered (e.g. between a forward and its backward) stays gathered.

    After `initialize`, a change reaches training when the optimizer steps the shards themselves (fp32 without
    offload); under bf16/fp16 or offload its separate fp32 masters overwrite the shards at the next step.
    Difference: DeepSpeed's ZeRO-3 optimizer steps its own fp32 copy in fp32 training too, so there the change
    reaches the next forward only and the step overwrites it. Modify weights before `initialize` (as scripts load
    them) for the same result in both."""

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None,
                 fwd_module: Any = None, enabled: bool = True):
        """`fwd_module` is accepted for DeepSpeed's call sites; it registers nothing here (no external
        parameters to track)."""
        self.params = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._located: list[tuple[torch.Tensor, ParamLocation]] = []
        self._gathered: list[tuple[ParamLocation, Unit]] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        self._located = [(p, at) for p in self.params if (at := getattr(p, LOCATION_ATTR, None)) is not None]
        if self.modifier_rank is not None and self._located:
            size = self._located[0][1].comm.size
            if not 0 <= self.modifier_rank < size:
                raise UserError(f"GatheredParameters(modifier_rank={self.modifier_rank}): it must be a rank of the "
                                f"data-parallel group, 0 to {size - 1}")
        seen: set[int] = set()
        for _, at in self._located:
            u = at.unit
            if u is None or id(u) in seen:
                continue
            seen.add(id(u))
            if u.gather_state is not GatherState.UNSHARDED:
                at.gatherer.gather_unit(u)
                self._gathered.append((at, u))
        return self

    @torch.no_grad()
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None and self.modifier_rank is not None:
                for p, at in self._located:
                    at.comm.broadcast(p.data, src_group_rank=self.modifier_rank)
                    if at.flat is not None:
                        at.flat.copy_piece(at.index, p.data)
        finally:
            for at, u in self._gathered:
                at.gatherer.free_unit(u)
            self._gathered, self._located = [], []
