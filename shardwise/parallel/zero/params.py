"""ZeRO stage 3 parameter partitioning: units, flat shards, gather and free.

A *unit* is a set of parameters gathered together. By default each child of the model's largest
`nn.ModuleList` (a transformer block) is a unit, and one root unit (whose module is the model itself) holds
every other parameter: embeddings, final norm, lm-head, and any parameter shared by two units. Parameters
with at most `stage3_param_persistence_threshold` elements (DeepSpeed's rule: `numel <= threshold`, taken in
`named_parameters()` order while their total stays within `stage3_model_persistence_threshold`) stay whole on
every rank ("persistent") and belong to no unit; stage3.py treats them like ZeRO-2 buckets.

Each unit holds one FlatShard per key (optimizer param group, dtype) of its parameters:

    shard      [S]        model dtype   this rank's part, S = padded // dp: the only copy kept between uses
    full       [padded]   model dtype   gathered buffer, padded = dp * S: allocated at the first gather, its
                                        storage resized to 0 bytes while the unit is free
    param.data full[off : off + numel].view(shape) while gathered; an empty [0] tensor while free

The flat's layout (`partition.py`) says where each parameter sits. The engine's `FlatLayout` is contiguous
element ranges, and the all-gather writes `full` directly. The wrappers' `RowLayout` gives each rank dim-0 rows
of every parameter: the all-gather lands in a transient rank-major [dp, S] buffer, and `layout.copy_out` moves
it into `full` (parameter-major) in one split-copy.

Freeing resizes the buffer's storage to 0 bytes rather than dropping it: autograd may have saved a view of a
weight during forward (F.linear saves `weight.t()`), and that view keeps pointing at the same storage, which
holds the right values again once the unit is re-gathered for backward, and no memory in between.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from shardwise.comm.collectives import Comm, Handle
from shardwise.parallel.zero.copies import CopyStream, wait_stream
from shardwise.parallel.zero.partition import FlatLayout, RowLayout


class UnitState(enum.Enum):
    FREE = "free"              # only the shard exists
    GATHERING = "gathering"    # all-gather launched (a prefetch), not waited on yet
    GATHERED = "gathered"      # parameters point into the full buffer


@dataclass(frozen=True)
class FlatKey:
    group: int | None          # optimizer param-group index; None: not optimized (frozen or not passed)
    dtype: torch.dtype


def _resize(t: torch.Tensor, numel: int) -> None:
    storage = t.untyped_storage()
    if storage.nbytes() != numel * t.element_size():
        storage.resize_(numel * t.element_size())


@dataclass(eq=False)
class FlatShard:
    """One padded flat buffer of a unit (one key), sharded over the dp group. Quacks like a ZeroBucket for
    `ShardedUpdate` (`group`, `params`, `param_shard`, `grad_shard`, `layout`)."""

    unit: int
    key: FlatKey
    params: list[nn.Parameter]
    shapes: list[torch.Size]
    layout: FlatLayout | RowLayout
    rank: int
    shard: torch.Tensor                  # [S]
    full: torch.Tensor | None            # [padded], allocated at the first gather; 0 bytes while free
    views: list[torch.Tensor]            # views[i] = full[off_i : off_i + n_i].view(shapes[i])
    empty: torch.Tensor                  # [0] placeholder every parameter points at while free
    grad_shard: torch.Tensor | None      # [S] averaged gradient, summed over micro-batches (optimized keys)
    pieces: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # i -> (lo, hi, start in shard)
    # backward bookkeeping, owned by stage3.ZeroParamRuntime
    grad_full: torch.Tensor | None = None     # [padded] this micro-batch's gradients, while being reduced
    ready: int = 0                            # parameters whose gradient arrived in this backward
    launched: bool = False
    received: torch.Tensor | None = None      # [S] reduce-scatter output
    handle: Handle | None = None
    # ZeRO-Offload of parameters: the shard lives on the CPU between uses and is copied to this device
    # (non-blocking from pinned memory) for each all-gather. None: the shard's own device.
    compute_device: torch.device | None = None
    # Mixed precision with the shard as the master (the module wrappers): the shard keeps key.dtype (fp32), the
    # gathered buffer is compute_dtype (bf16), gradients are reduced in reduce_dtype. None: key.dtype.
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    # The module wrappers: while free, parameter i views its piece of the shard, shaped layout.local_shape (its
    # dim-0 rows under RowLayout), and its .grad the same piece of grad_shard, so an optimizer built on the
    # module's parameters steps the shard in place.
    rest_on_shard: bool = False
    grads_held: bool = False                  # grad_shard holds gradients the free parameters show as .grad

    @classmethod
    def allocate(cls, unit: int, key: FlatKey, params: list[nn.Parameter], shapes: list[torch.Size], *,
                 dp_size: int, rank: int, device: torch.device, grad_shard: bool = True,
                 layout_type: type[FlatLayout] | type[RowLayout] = FlatLayout) -> "FlatShard":
        """A zeroed shard (and, for an optimized key when `grad_shard`, a zeroed gradient shard)."""
        layout = layout_type.of_shapes(shapes, dp_size)
        shard = torch.zeros(layout.shard_numel, dtype=key.dtype, device=device)
        flat = cls(unit, key, params, list(shapes), layout, rank, shard, None, [],
                   torch.empty(0, dtype=key.dtype, device=device),
                   torch.zeros_like(shard) if key.group is not None and grad_shard else None)
        flat.pieces = {i: (lo, hi, dst) for i, lo, hi, dst in layout.pieces_in_shard(rank)}
        return flat

    @property
    def group(self) -> int | None:
        return self.key.group

    @property
    def param_shard(self) -> torch.Tensor:
        return self.shard

    @torch.no_grad()
    def take(self, i: int, value: torch.Tensor, into: torch.Tensor | None = None) -> None:
        """Copy this rank's part of parameter i, given its full value (any shape), into the shard (or into
        `into`, a tensor laid out like the shard)."""
        if i in self.pieces:
            lo, hi, dst = self.pieces[i]
            (self.shard if into is None else into)[dst:dst + hi - lo].copy_(value.reshape(-1)[lo:hi])

    def local_views(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Per parameter, its piece of `t` (a tensor laid out like the shard), shaped as the parameter rests."""
        out = []
        for i in range(len(self.params)):
            lo, hi, dst = self.pieces.get(i, (0, 0, 0))
            out.append(t[dst:dst + hi - lo].view(self.layout.local_shape(i, self.rank)))
        return out

    def offload(self, device: torch.device, *, pin_memory: bool) -> None:
        """Keep the shard on `device` (the CPU) between uses; gathers still happen on the compute device."""
        self.compute_device = self.shard.device
        # One host copy, page-locked when asked (and CUDA exists), so the gathers' H2D copies can be asynchronous.
        host = torch.empty(self.shard.shape, dtype=self.shard.dtype, device=device,
                           pin_memory=pin_memory and torch.cuda.is_available())
        self.shard = host.copy_(self.shard)

    def launch_gather(self, comm: Comm, copies: CopyStream | None = None) -> Handle:
        """All-gather the unit's buffer. An offloaded shard is copied to the device and gathered on `copies`' side
        stream (after the work queued so far), so a prefetch overlaps the compute queued after it; waiting on the
        handle makes the current stream wait for both."""
        device = self.compute_device or self.shard.device
        dtype = self.compute_dtype or self.key.dtype
        if self.layout.gathers_in_place:
            self._fill_full(device, dtype)
            return self._gather_into(self.full, comm, copies, device, dtype)
        # rank-major [dp * S], transient: allocated on the compute stream, which alone reads it (copy_out); the
        # full buffer gets its memory only then, so a prefetch in flight holds one [padded] buffer, not two
        staged = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
        inner = self._gather_into(staged, comm, copies, device, dtype)

        def wait() -> None:
            inner.wait()
            self._fill_full(device, dtype)
            self.layout.copy_out(staged, self.full)

        return Handle(wait, lambda: None)

    def _fill_full(self, device: torch.device, dtype: torch.dtype) -> None:
        """Give the full buffer its memory back (the same storage, so saved views of weights stay valid)."""
        if self.full is None:
            self.full = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
            self.views = [self.full[o:o + n].view(s)
                          for o, n, s in zip(self.layout.offsets, self.layout.sizes, self.shapes)]
        else:
            _resize(self.full, self.layout.padded_numel)

    def _gather_into(self, out: torch.Tensor, comm: Comm, copies: CopyStream | None, device: torch.device,
                     dtype: torch.dtype) -> Handle:
        send = self.shard
        if device == send.device and dtype == send.dtype:
            return comm.all_gather_into_tensor(out, send, async_op=True)
        if copies is None or copies.stream is None or device == send.device:
            # a transient [S] copy on the compute stream: a cast on the device, or H2D without a copy stream
            return comm.all_gather_into_tensor(out, send.to(device, dtype, non_blocking=True), async_op=True)
        with copies.stream_context():
            send = send.to(device, dtype, non_blocking=True)          # pinned host -> device, async
            inner = comm.all_gather_into_tensor(out, send, async_op=True)
            done = copies.join()

        def wait() -> None:
            inner.wait()
            wait_stream(done, device)         # also a world-1 local copy made on the side stream

        return Handle(wait, lambda: None)

    def attach(self) -> None:
        if self.rest_on_shard:
            self._take_back_grads()
        for p, v in zip(self.params, self.views):
            p.data = v

    def release(self) -> None:
        if self.rest_on_shard:
            pieces, grads = self.resting_views()
            for p, v in zip(self.params, pieces):
                p.data = v
            if self.grads_held:
                for p, g in zip(self.params, grads):
                    p.grad = g
        else:
            for p in self.params:
                p.data = self.empty
        if self.full is not None:
            _resize(self.full, 0)

    def resting_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Per parameter: its piece of the shard (shaped `layout.local_shape`, empty when none is on this rank),
        and of grad_shard."""
        grads = self.local_views(self.grad_shard) if self.grad_shard is not None else [None] * len(self.params)
        return self.local_views(self.shard), grads

    @torch.no_grad()
    def _take_back_grads(self) -> None:
        """Before a gather: what the user did to the shown gradients goes into grad_shard (a .grad set to None,
        optimizer.zero_grad's default, zeroes its piece; a replaced one is copied in); then .grad is cleared so
        that autograd accumulates this backward's full-shape gradient afresh."""
        if self.grads_held:
            _, grads = self.resting_views()
            for p, g in zip(self.params, grads):
                if p.grad is None:
                    g.zero_()
                elif p.grad.data_ptr() != g.data_ptr() or p.grad.shape != g.shape:
                    g.copy_(p.grad)
        for p in self.params:
            p.grad = None


@dataclass(eq=False)
class Unit:
    index: int
    name: str
    module: nn.Module
    flats: list[FlatShard]
    is_root: bool = False
    reshard_after_forward: bool = True        # False: stays gathered from its training forward to its backward
    state: UnitState = UnitState.FREE
    handles: list[Handle] = field(default_factory=list)

    @property
    def padded_numel(self) -> int:
        return sum(f.layout.padded_numel for f in self.flats)

    def launch_gather(self, comm: Comm, copies: CopyStream | None = None) -> None:
        if self.state is UnitState.FREE:
            self.handles = [f.launch_gather(comm, copies) for f in self.flats]
            self.state = UnitState.GATHERING

    def wait(self) -> None:
        if self.state is UnitState.GATHERING:
            for h in self.handles:
                h.wait()
            self.handles = []
            for f in self.flats:
                f.attach()
            self.state = UnitState.GATHERED

    def free(self) -> None:
        self.wait()          # never resize a buffer an all-gather is still writing into
        if self.state is UnitState.GATHERED:
            for f in self.flats:
                f.release()
            self.state = UnitState.FREE


@dataclass(eq=False)
class Partition:
    """What a stage-3 model is made of on this rank: its units and its persistent (whole) parameters."""

    units: list[Unit]
    persistent: list[nn.Parameter]
    dp_size: int
    dp_rank: int
    persistence_threshold: int
    model_persistence_threshold: int

    @property
    def flats(self) -> list[FlatShard]:
        return [f for u in self.units for f in u.flats]

    def where(self) -> dict[int, tuple[FlatShard, int]]:
        return {id(p): (f, i) for f in self.flats for i, p in enumerate(f.params)}


PARTITION_ATTR = "_shardwise_zero3_partition"
"""Attribute of a model built by `materialize_sharded` (or adopted by stage 3) holding its Partition."""


# -- planning ---------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class UnitPlan:
    name: str
    module: nn.Module
    params: list[nn.Parameter]
    is_root: bool = False


def default_unit_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of the model's largest nn.ModuleList (most parameters; the first one on ties)."""
    best: tuple[str, nn.ModuleList] | None = None
    best_numel = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = (name, module), numel
    if best is None:
        return []
    return [(f"{best[0]}.{i}", child) for i, child in enumerate(best[1])]


def plan_units(model: nn.Module, *, persistence_threshold: int, model_persistence_threshold: int,
               modules: list[tuple[str, nn.Module]] | None = None) -> tuple[list[UnitPlan], list[nn.Parameter]]:
    """Assign every parameter (shared ones once) to a unit, the root unit, or the persistent set.
    Needs real shapes: call it on a full or meta-device model, before sharding."""
    modules = default_unit_modules(model) if modules is None else modules
    owners: dict[int, list[int]] = {}
    for k, (_, module) in enumerate(modules):
        for p in module.parameters():
            owners.setdefault(id(p), []).append(k)
    persistent: list[nn.Parameter] = []
    persistent_numel = 0
    per_unit: list[list[nn.Parameter]] = [[] for _ in modules]
    root: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        n = p.numel()
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
                layout_type: type[FlatLayout] | type[RowLayout] = FlatLayout) -> list[Unit]:
    """Units with zeroed shards (fill them with FlatShard.take); one flat per key, keys in first-seen order."""
    units = []
    for index, plan in enumerate(plans):
        by_key: dict[FlatKey, list[nn.Parameter]] = {}
        for p in plan.params:
            by_key.setdefault(key_of(p), []).append(p)
        flats = [FlatShard.allocate(index, key, ps, [shape_of(p) for p in ps], dp_size=dp_size, rank=dp_rank,
                                    device=device, grad_shard=grad_shards, layout_type=layout_type)
                 for key, ps in by_key.items()]
        units.append(Unit(index, plan.name, plan.module, flats, is_root=plan.is_root))
    return units


@torch.no_grad()
def shard_model(model: nn.Module, *, key_of: Callable[[nn.Parameter], FlatKey], dp_size: int, dp_rank: int,
                persistence_threshold: int, model_persistence_threshold: int,
                modules: list[tuple[str, nn.Module]] | None = None, device: torch.device | None = None,
                grad_shards: bool = True) -> Partition:
    """Shard a materialized model in place: each rank keeps its shard of every unit; parameters become empty
    placeholders. The full model existed on this rank before the call (see materialize.py to avoid that).
    The shards go to `device` (default: the parameters'), copied one parameter at a time."""
    plans, persistent = plan_units(model, persistence_threshold=persistence_threshold,
                                   model_persistence_threshold=model_persistence_threshold, modules=modules)
    device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
    units = build_units(plans, key_of=key_of, shape_of=lambda p: p.shape, dp_size=dp_size, dp_rank=dp_rank,
                        device=device, grad_shards=grad_shards)
    for f in (f for u in units for f in u.flats):
        for i, p in enumerate(f.params):
            f.take(i, p.detach())
        f.release()
    return Partition(units, persistent, dp_size, dp_rank, persistence_threshold, model_persistence_threshold)


@torch.no_grad()
def rekey(partition: Partition, *, key_of: Callable[[nn.Parameter], FlatKey], comm: Comm,
          device: torch.device) -> Partition:
    """The same units with flats re-keyed (new param groups and/or dtype). A flat whose parameters all get
    one new key keeps its layout and is converted locally; otherwise its unit is gathered (collective: every
    rank takes the same branch, the keys are the same everywhere) and re-sharded."""
    units = []
    for u in partition.units:
        plan = UnitPlan(u.name, u.module, [p for f in u.flats for p in f.params], u.is_root)
        shapes = {id(p): s for f in u.flats for p, s in zip(f.params, f.shapes)}
        (new,) = build_units([plan], key_of=key_of, shape_of=lambda p: shapes[id(p)], dp_size=partition.dp_size,
                             dp_rank=partition.dp_rank, device=device)
        new.index = u.index
        where = {id(p): (f, i) for f in new.flats for i, p in enumerate(f.params)}
        same_layout = {id(f.params[0]): f for f in new.flats}
        ids = lambda flat: [id(p) for p in flat.params]  # noqa: E731
        if all(id(f.params[0]) in same_layout and ids(same_layout[id(f.params[0])]) == ids(f) for f in u.flats):
            for f in u.flats:
                same_layout[id(f.params[0])].shard.copy_(f.shard)     # converts dtype/device
        else:
            u.launch_gather(comm)
            u.wait()
            for f in u.flats:
                for p, view in zip(f.params, f.views):
                    target, i = where[id(p)]
                    target.take(i, view)
            u.free()
        for f in new.flats:
            f.unit = u.index
            f.release()
        units.append(new)
    return Partition(units, partition.persistent, partition.dp_size, partition.dp_rank,
                     partition.persistence_threshold, partition.model_persistence_threshold)


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
        if flat.rest_on_shard and value.shape == p.shape:
            continue                            # this rank's piece (a wrapper's sharded state dict): loaded as is
        if value.numel() == flat.layout.sizes[i] and value.numel() > 0:
            if tuple(value.shape) != tuple(flat.shapes[i]):
                raise ValueError(f'state_dict["{name}"] has shape {tuple(value.shape)}, the parameter '
                                 f'{tuple(flat.shapes[i])}')
            flat.take(i, value.to(flat.shard.device))
            if flat.rest_on_shard:              # the piece now holds the value: load_state_dict copies it onto itself
                state_dict[name] = flat.resting_views()[0][i]
                continue
        elif value.numel() == 0:
            placeholders.append(name)
        else:
            raise ValueError(f'state_dict["{name}"] has {value.numel()} elements; the parameter has '
                             f'{flat.layout.sizes[i]} (shape {tuple(flat.shapes[i])})')
        state_dict[name] = flat.empty
    return placeholders
