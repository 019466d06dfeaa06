"""ZeRO-3's units: sets of parameters gathered and freed together (`Unit`, with its two lifecycle states), how a
model is cut into them (`plan_units`), and sharding a model into them (`shard_model`, `rekey`). Each unit holds
one `FlatShard` (`flat.py`) per key (optimizer param group, dtype) of its parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from shardwise.comm.collectives import Comm, Handle
from shardwise.parallel.replicas import ReplicaComms
from shardwise.parallel.zero.copies import CopyStream
from shardwise.parallel.zero.flat import FlatKey, FlatShard
from shardwise.parallel.zero.partition import FlatLayout, RowLayout
from shardwise.parallel.zero.states import (GATHER_MOVES, PARAM_STATUS, TRAINING_MOVES, GatherState, TrainingState,
                                           advance)


@dataclass(eq=False)
class Unit:
    """Parameters gathered and freed together, one FlatShard per key, with its two lifecycle states (`states.py`):
    the gather state changes through `start_gather` / `finish_gather` / `reshard`, the training state through
    `move_training`."""

    index: int
    name: str
    module: nn.Module
    flats: list[FlatShard]
    is_root: bool = False
    reshard_after_forward: bool = True        # False: stays gathered from its training forward to its backward
    gather_state: GatherState = GatherState.SHARDED
    training_state: TrainingState = TrainingState.IDLE
    handles: list[Handle] = field(default_factory=list)
    # the engine's ZeRO-3 units (not the module wrappers'): each gather-state change is shown on the parameters
    # as DeepSpeed's `ds_status` (`gathered.record_locations`)
    marks_status: bool = False

    @property
    def padded_numel(self) -> int:
        return sum(f.layout.padded_numel for f in self.flats)

    def _move_gather(self, to: GatherState) -> None:
        self.gather_state = advance(GATHER_MOVES, self.gather_state, to, f"ZeRO-3 unit {self.name}")
        if self.marks_status:
            status = PARAM_STATUS[to]
            for f in self.flats:
                for p in f.params:
                    p.ds_status = status  # type: ignore[attr-defined]

    def move_training(self, to: TrainingState) -> None:
        self.training_state = advance(TRAINING_MOVES, self.training_state, to, f"ZeRO-3 unit {self.name}")

    def start_gather(self, comm: Comm, copies: CopyStream | None = None) -> None:
        """SHARDED -> GATHERING: launch the all-gather of every flat."""
        self._move_gather(GatherState.GATHERING)
        self.handles = [f.launch_gather(f.comm if f.comm is not None else comm, copies) for f in self.flats]

    def finish_gather(self) -> None:
        """GATHERING -> UNSHARDED: wait for the all-gathers; the parameters view the full buffers."""
        self._move_gather(GatherState.UNSHARDED)
        for h in self.handles:
            h.wait()
        self.handles = []
        for f in self.flats:
            f.attach()

    def reshard(self) -> None:
        """UNSHARDED -> SHARDED: the full buffers give their memory back; the parameters are placeholders again."""
        self._move_gather(GatherState.SHARDED)
        for f in self.flats:
            f.release()

    def gather(self, comm: Comm, copies: CopyStream | None = None) -> None:
        """Whole now, from any state (a prefetch in flight is waited on)."""
        if self.gather_state is GatherState.SHARDED:
            self.start_gather(comm, copies)
        if self.gather_state is GatherState.GATHERING:
            self.finish_gather()

    def free(self) -> None:
        """Sharded now, from any state: an all-gather in flight is waited on first (never resize a buffer it is
        still writing into)."""
        if self.gather_state is GatherState.GATHERING:
            self.finish_gather()
        if self.gather_state is GatherState.UNSHARDED:
            self.reshard()


@dataclass(eq=False)
class Partition:
    """What a stage-3 model is made of on this rank: its units and its persistent (whole) parameters."""

    units: list[Unit]
    persistent: list[nn.Parameter]
    dp_size: int
    dp_rank: int
    persistence_threshold: int
    model_persistence_threshold: int
    # zero.Init's: every parameter sharded (none persistent yet), as in DeepSpeed, whose zero.Init partitions
    # every parameter; `initialize` picks the persistent ones by its config's thresholds (`rekey`'s `persistent`)
    persistence_deferred: bool = False

    @property
    def flats(self) -> list[FlatShard]:
        return [f for u in self.units for f in u.flats]

    def where(self) -> dict[int, tuple[FlatShard, int]]:
        """id(parameter) -> (its flat, its index there), for every sharded parameter."""
        return {id(p): (f, i) for f in self.flats for i, p in enumerate(f.params)}


PARTITION_ATTR = "_shardwise_zero3_partition"
"""Attribute of a model built by `materialize_sharded` (or adopted by stage 3) holding its Partition."""


# -- planning ---------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class UnitPlan:
    """A unit before its flats exist: which parameters, gathered around which module's forward."""

    name: str
    module: nn.Module
    params: list[nn.Parameter]
    is_root: bool = False


def default_unit_modules(model: nn.Module, shape_of: Callable[[nn.Parameter], torch.Size] | None = None
                         ) -> list[tuple[str, nn.Module]]:
    """Children of the model's largest nn.ModuleList (most parameters; the first one on ties). A model sharded
    already (its Partition recorded: zero.Init, materialize_sharded) is measured by its parameters' recorded
    shapes, not by their empty placeholders."""
    partition: Partition | None = getattr(model, PARTITION_ATTR, None)
    if shape_of is None and partition is not None:
        recorded = {id(p): shape for f in partition.flats for p, shape in zip(f.params, f.shapes)}
        shape_of = lambda p: recorded.get(id(p), p.shape)  # noqa: E731
    best: tuple[str, nn.ModuleList] | None = None
    best_numel = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            numel = sum(p.numel() if shape_of is None else math.prod(shape_of(p)) for p in module.parameters())
            if numel > best_numel:
                best, best_numel = (name, module), numel
    if best is None:
        return []
    return [(f"{best[0]}.{i}", child) for i, child in enumerate(best[1])]


def plan_units(model: nn.Module, *, persistence_threshold: int, model_persistence_threshold: int,
               modules: list[tuple[str, nn.Module]] | None = None,
               shape_of: Callable[[nn.Parameter], torch.Size] | None = None
               ) -> tuple[list[UnitPlan], list[nn.Parameter]]:
    """Assign every parameter (shared ones once) to a unit, the root unit, or the persistent set. Needs real
    shapes: call it on a full or meta-device model, before sharding, or give `shape_of` (parameters that are
    placeholders already).

    Each of `modules` (default: the children of the model's largest `nn.ModuleList`, the transformer blocks) is a
    unit of the parameters it alone holds; one root unit (whose module is the model itself) holds every other
    parameter: embeddings, final norm, lm-head, and any parameter shared by two units. Parameters with at most
    `persistence_threshold` elements (DeepSpeed's rule: `numel <= threshold`, taken in `named_parameters()` order
    while their total stays within `model_persistence_threshold`) stay whole on every rank ("persistent") and
    belong to no unit; the stage-3 runtime reduces their gradients as ZeRO-2 buckets."""
    modules = default_unit_modules(model, shape_of) if modules is None else modules
    owners: dict[int, list[int]] = {}
    for k, (_, module) in enumerate(modules):
        for p in module.parameters():
            owners.setdefault(id(p), []).append(k)
    persistent: list[nn.Parameter] = []
    persistent_numel = 0
    per_unit: list[list[nn.Parameter]] = [[] for _ in modules]
    root: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        n = p.numel() if shape_of is None else math.prod(shape_of(p))
        if n + persistent_numel <= model_persistence_threshold and n <= persistence_threshold:
            persistent.append(p)
            persistent_numel += n
            continue
        ks = owners.get(id(p), [])
        (per_unit[ks[0]] if len(ks) == 1 else root).append(p)
    plans = [UnitPlan(name, m, ps) for (name, m), ps in zip(modules, per_unit) if ps]
    if root:
        plans.append(UnitPlan("<root>", model, root, is_root=True))
    return plans, persistent


def build_units(plans: list[UnitPlan], *, key_of: Callable[[nn.Parameter], FlatKey],
                shape_of: Callable[[nn.Parameter], torch.Size], dp_size: int, dp_rank: int,
                device: torch.device, grad_shards: bool = True,
                layout_type: type[FlatLayout] | type[RowLayout] = FlatLayout,
                comms: ReplicaComms | None = None) -> list[Unit]:
    """Units with zeroed shards (fill them with FlatShard.copy_piece); one flat per key, keys in first-seen
    order. A key with a replica group is sharded over that group's `Comm` (from `comms`) instead of dp."""
    units = []
    for index, plan in enumerate(plans):
        by_key: dict[FlatKey, list[nn.Parameter]] = {}
        for p in plan.params:
            by_key.setdefault(key_of(p), []).append(p)
        flats = []
        for key, ps in by_key.items():
            comm = comms.of(key.replicas) if comms is not None else None
            flat = FlatShard.allocate(index, key, ps, [shape_of(p) for p in ps],
                                      dp_size=dp_size if comm is None else comm.size,
                                      rank=dp_rank if comm is None else comm.rank,
                                      device=device, grad_shard=grad_shards, layout_type=layout_type)
            flat.comm = comm
            flats.append(flat)
        units.append(Unit(index, plan.name, plan.module, flats, is_root=plan.is_root))
    return units


@torch.no_grad()
def shard_model(model: nn.Module, *, key_of: Callable[[nn.Parameter], FlatKey], dp_size: int, dp_rank: int,
                persistence_threshold: int, model_persistence_threshold: int,
                modules: list[tuple[str, nn.Module]] | None = None, device: torch.device | None = None,
                grad_shards: bool = True, comms: ReplicaComms | None = None) -> Partition:
    """Shard a materialized model in place: each rank keeps its shard of every unit; parameters become empty
    placeholders. The full model existed on this rank before the call (see materialize.py to avoid that).
    The shards go to `device` (default: the parameters'), copied one parameter at a time."""
    plans, persistent = plan_units(model, persistence_threshold=persistence_threshold,
                                   model_persistence_threshold=model_persistence_threshold, modules=modules)
    device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
    units = build_units(plans, key_of=key_of, shape_of=lambda p: p.shape, dp_size=dp_size, dp_rank=dp_rank,
                        device=device, grad_shards=grad_shards, comms=comms)
    for f in (f for u in units for f in u.flats):
        for i, p in enumerate(f.params):
            f.copy_piece(i, p.detach())
        f.release()
    return Partition(units, persistent, dp_size, dp_rank, persistence_threshold, model_persistence_threshold)


@torch.no_grad()
def rekey(partition: Partition, *, key_of: Callable[[nn.Parameter], FlatKey], comm: Comm,
          device: torch.device, persistent: list[nn.Parameter] | None = None,
          thresholds: tuple[int, int] | None = None) -> Partition:
    """The same units with flats re-keyed (new param groups and/or dtype). A flat whose parameters all get
    one new key keeps its layout and is converted locally; otherwise its unit is gathered (collective: every
    rank takes the same branch, the keys are the same everywhere) and re-sharded.

    `persistent` (a deferred partition's: zero.Init sharded every parameter) are taken out of their units and
    kept whole on every rank from now on; a unit left with no parameter is dropped. `thresholds` (param, model)
    are then the ones they were chosen by."""
    leaving = {id(p) for p in persistent or []}
    # the training dtype (the caller's cast reached the placeholders), read before a gather re-points them
    dtype_of = {id(p): key_of(p).dtype for p in persistent or []}
    units: list[Unit] = []
    for u in partition.units:
        staying = [p for f in u.flats for p in f.params if id(p) not in leaving]
        shapes = {id(p): s for f in u.flats for p, s in zip(f.params, f.shapes)}
        left = [p for f in u.flats for p in f.params if id(p) in leaving]
        if not staying:
            u.gather(comm)
            whole = {id(p): v.clone() for f in u.flats for p, v in zip(f.params, f.views)}
            u.free()
            for p in left:
                p.data = whole[id(p)].to(device, dtype_of[id(p)])
            continue
        plan = UnitPlan(u.name, u.module, staying, u.is_root)
        (new,) = build_units([plan], key_of=key_of, shape_of=lambda p: shapes[id(p)], dp_size=partition.dp_size,
                             dp_rank=partition.dp_rank, device=device)
        new.index = len(units)
        where = {id(p): (f, i) for f in new.flats for i, p in enumerate(f.params)}
        same_layout = {id(f.params[0]): f for f in new.flats}
        ids = lambda flat: [id(p) for p in flat.params]  # noqa: E731
        if not left and all(id(f.params[0]) in same_layout and ids(same_layout[id(f.params[0])]) == ids(f)
                            for f in u.flats):
            for f in u.flats:
                same_layout[id(f.params[0])].shard.copy_(f.shard)     # converts dtype/device
        else:
            u.gather(comm)
            whole = {}
            for f in u.flats:
                for p, view in zip(f.params, f.views):
                    if id(p) in leaving:
                        whole[id(p)] = view.clone()
                        continue
                    target, i = where[id(p)]
                    target.copy_piece(i, view)
            u.free()                              # every old parameter back on the placeholder: then the whole ones
            for p in left:
                p.data = whole[id(p)].to(device, dtype_of[id(p)])
        for f in new.flats:
            f.unit = new.index
            f.release()
        units.append(new)
    param_threshold, model_threshold = thresholds or (partition.persistence_threshold,
                                                      partition.model_persistence_threshold)
    return Partition(units, [*partition.persistent, *(persistent or [])], partition.dp_size, partition.dp_rank,
                     param_threshold, model_threshold)


@torch.no_grad()
def load_full_tensors(partition: Partition, named: dict[str, nn.Parameter], state_dict: dict) -> list[str]:
    """For each sharded parameter whose entry in `state_dict` holds its full value, copy this rank's part into
    the shard and replace the entry by the empty placeholder (so `load_state_dict` then matches shapes).
    Returns the names whose entries were placeholders themselves (a per-rank ZeRO-3 checkpoint's module
    states): those carry no values."""
    where = partition.where()
    placeholders = []
    for name, p in named.items():
        if id(p) not in where or name not in state_dict:
            continue
        flat, i = where[id(p)]
        value = state_dict[name]
        if flat.params_view_shard and value.shape == p.shape:
            continue                            # this rank's piece (a wrapper's sharded state dict): loaded as is
        if value.numel() == flat.layout.sizes[i] and value.numel() > 0:
            if tuple(value.shape) != tuple(flat.shapes[i]):
                raise ValueError(f'state_dict["{name}"] has shape {tuple(value.shape)}, the parameter '
                                 f'{tuple(flat.shapes[i])}')
            flat.copy_piece(i, value.to(flat.shard.device))
            if flat.params_view_shard:          # the piece now holds the value: load_state_dict copies it onto itself
                state_dict[name] = flat.shard_pieces()[0][i]
                continue
        elif value.numel() == 0:
            placeholders.append(name)
        else:
            raise ValueError(f'state_dict["{name}"] has {value.numel()} elements; the parameter has '
                             f'{flat.layout.sizes[i]} (shape {tuple(flat.shapes[i])})')
        state_dict[name] = flat.empty
    return placeholders
