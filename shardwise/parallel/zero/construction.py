"""Sharding a model while it is constructed (what `zero.Init()` does as a context): each module's parameters are cut
to this rank's piece once the module is complete, a later touch of such a parameter gathers it back for the
duration, and at the end of the block the pieces are laid out again as ZeRO-3 units (`Partition`).

When is a module complete? When it is registered as another module's child (`parent.child = module`,
`nn.ModuleList([...])`, `add_module`): its constructor has returned by then, so whatever the constructor wrote (a
`reset_parameters`, an `nn.Parameter(torch.zeros(8))`, a custom init) is in the values that get sharded. The model
itself (a module no other module holds) is complete at the end of the block. A parameter registered later on a
complete module (transformers' `from_pretrained` assigns loaded weights one by one; `tie_weights` assigns the
embedding to the head) is sharded as it is registered. Parameters of at most `keep_whole_numel` elements stay whole
(they become ZeRO-3's persistent parameters anyway).

Code that runs after a child is sharded and reads or writes its parameters (a parent's `init_weights()`,
transformers' `post_init()`, a weight tie that copies) sees the whole values: a `TorchFunctionMode` catches every
torch function given a sharded parameter, all-gathers it first (its shape, size, numel and dim are answered from
the record, with no gather), and leaves it gathered while the code keeps touching the parameters of the same module;
the first touch of another module's parameter shards the gathered ones again. So the values after the block are
exactly those the same constructors give outside it under the same seed (they run on the same device with the same
random draws), and a rank holds, beyond its shards, one module's parameters: the one under construction or the one
being touched. A tensor derived from a gathered parameter (`w = layer.weight.detach()`) keeps its memory alive after
the parameter is sharded again, and a write through it afterwards is lost.

Every rank must construct the same model and touch the same parameters in the same order (each gather is a
collective), as under DeepSpeed's `zero.Init`. Whenever a whole value is cut, rank 0's value is broadcast first, so
ranks agree even when their seeds differ.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

from shardwise.comm.collectives import Comm
from shardwise.errors import UserError
from shardwise.parallel.zero.flat import FlatKey
from shardwise.parallel.zero.params import Partition, build_units, plan_units

SHARD_ATTR = "_shardwise_construction_shard"
"""Attribute of a parameter sharded during construction: its `ConstructionShard`."""

# Torch functions that read only what the placeholder shows correctly (dtype, device, flags): no gather.
_PASS_THROUGH = frozenset({
    "dtype.get", "device.get", "requires_grad.get", "is_leaf.get", "grad.get", "grad_fn.get", "layout.get",
    "is_cuda.get", "is_meta.get", "is_sparse.get", "is_quantized.get", "_version.get", "names.get",
    "is_floating_point", "is_complex", "element_size", "requires_grad_", "get_device",
})


@dataclass(eq=False)
class ConstructionShard:
    """One parameter between its module's completion and the end of the block."""

    shape: torch.Size
    home: torch.device       # its value's device when cut (the constructor's): a gathered value goes back there
    owner: int               # id() of the module holding it when sharded: touches of one owner keep each other
    shard: torch.Tensor      # [ceil(numel / dp)]: this rank's piece of the flattened value, zero-padded at the end

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):            # a property of Tensor: name it by the property
        return f"{getattr(getattr(func, '__self__', None), '__name__', '')}.{name[2:5]}"
    return name


def _sharded_in(value: Any, out: list[nn.Parameter]) -> None:
    if isinstance(value, nn.Parameter):
        if hasattr(value, SHARD_ATTR):
            out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _sharded_in(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _sharded_in(v, out)


class ConstructionSharder(TorchFunctionMode):
    """The state of one `zero.Init()` block: which modules are complete, which parameters are gathered now, which
    modules were built in the block (`start` / `stop` bracket it)."""

    def __init__(self, comm: Comm, *, device: torch.device, dtype: torch.dtype | None, keep_whole_numel: int):
        super().__init__()
        self.comm = comm
        self.device = device                  # where the shards live (the compute device)
        self.dtype = dtype                    # zero.Init(dtype=): floating-point weights cast as they are sharded
        self.keep_whole_numel = keep_whole_numel
        self.complete: weakref.WeakSet[nn.Module] = weakref.WeakSet()    # (weak: an id() could be reused)
        self.gathered: dict[int, nn.Parameter] = {}
        self.current_owner: int | None = None
        self.built: dict[int, nn.Module] = {}     # modules given parameters or children in the block, first seen
        self.children: weakref.WeakSet[nn.Module] = weakref.WeakSet()    # ... those registered as a child
        self._hooks: list[Any] = []
        self._busy = False                    # our own tensor work passes through the mode

    # -- the block ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._hooks = [module_hooks.register_module_parameter_registration_hook(self._on_param),
                       module_hooks.register_module_module_registration_hook(self._on_child)]
        self.__enter__()

    def stop(self, *, failed: bool = False) -> list[nn.Module]:
        """End the block: every gathered parameter sharded again, the hooks removed. Returns the models built in
        it (modules no other module built in it holds) that have parameters. `failed` (the block raised, maybe on
        one rank only): no collective, the gathered parameters stay whole."""
        self.__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if failed:
            self.gathered = {}
            return []
        self._shard_gathered(keep=set())
        roots = self.models()
        return [m for m in roots if next(m.parameters(), None) is not None]

    def models(self) -> list[nn.Module]:
        """The modules built in the block that no other module built in it holds, first seen first."""
        return [m for m in self.built.values() if m not in self.children]

    # -- registration hooks: when modules are complete -----------------------------------------------------
    def _on_param(self, module: nn.Module, name: str, param: Any) -> None:
        self.built.setdefault(id(module), module)
        if isinstance(param, nn.Parameter) and module in self.complete:
            self._shard_new(param, module)

    def _on_child(self, module: nn.Module, name: str, child: Any) -> None:
        self.built.setdefault(id(module), module)
        if isinstance(child, nn.Module):
            self.children.add(child)
            for m in child.modules():
                self.complete.add(m)
                for p in m._parameters.values():
                    if p is not None:
                        self._shard_new(p, m)

    # -- the mode: touches of sharded parameters -----------------------------------------------------------
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._busy:
            return func(*args, **kwargs)
        sharded: list[nn.Parameter] = []
        _sharded_in(args, sharded)
        _sharded_in(kwargs, sharded)
        pending = [p for p in sharded if id(p) not in self.gathered]
        if pending:
            name = _func_name(func)
            if name in _PASS_THROUGH:
                return func(*args, **kwargs)
            if len(args) >= 1 and args[0] is pending[0] and len(pending) == 1:
                answer = self._metadata(name, pending[0], args[1:], kwargs)
                if answer is not None:
                    return answer
            self._gather(pending, touched={id(p) for p in sharded})
        return func(*args, **kwargs)

    @staticmethod
    def _metadata(name: str, p: nn.Parameter, rest: tuple, kwargs: dict) -> Any:
        """A shape query answered from the record (no gather)."""
        shape = getattr(p, SHARD_ATTR).shape
        if name in ("shape.get", "size") and not rest and not kwargs:
            return shape
        if name == "size":
            dim = rest[0] if rest else kwargs.get("dim")
            return shape[dim] if dim is not None else shape
        if name in ("dim", "ndim.get", "ndimension"):
            return len(shape)
        if name in ("numel", "nelement"):
            return math.prod(shape)
        if name == "__len__":
            if not shape:
                raise TypeError("len() of a 0-d tensor")
            return shape[0]
        return None

    # -- sharding and gathering ----------------------------------------------------------------------------
    @torch.no_grad()
    def _shard_new(self, p: nn.Parameter, owner: nn.Module) -> None:
        """Cut a whole parameter of a complete module (small ones stay whole, meta ones wait for their values)."""
        if hasattr(p, SHARD_ATTR) or p.device.type == "meta" or p.numel() <= self.keep_whole_numel:
            return
        self._busy = True
        try:
            setattr(p, SHARD_ATTR, ConstructionShard(p.shape, p.device, id(owner), torch.empty(0)))
            self._cut(p)
        finally:
            self._busy = False

    def _cut(self, p: nn.Parameter) -> None:
        """p holds a whole value: keep rank 0's value's piece for this rank, the parameter an empty placeholder."""
        record: ConstructionShard = getattr(p, SHARD_ATTR)
        value = p.data
        if self.dtype is not None and value.is_floating_point():
            value = value.to(self.dtype)
        flat = value.reshape(-1).to(self.device, copy=True)     # [numel]: broadcast writes into it
        self.comm.broadcast(flat, src_group_rank=0)
        per_rank = -(-flat.numel() // self.comm.size)
        lo = min(self.comm.rank * per_rank, flat.numel())
        hi = min(lo + per_rank, flat.numel())
        shard = torch.zeros(per_rank, dtype=flat.dtype, device=self.device)
        shard[:hi - lo].copy_(flat[lo:hi])
        # a write may have replaced the value (`.data = `, `.to()` inside the block): its shape and device count
        record.shape, record.shard, record.home = value.shape, shard, p.device
        p.data = torch.empty(0, dtype=flat.dtype, device=record.home)

    def _gather(self, pending: list[nn.Parameter], touched: set[int]) -> None:
        owner = getattr(pending[-1], SHARD_ATTR).owner
        if owner != self.current_owner:       # another module's parameters: the ones gathered so far go back
            self._shard_gathered(keep=touched)
            self.current_owner = owner
        self._busy = True
        try:
            for p in pending:
                p.data = self.full_value(p).to(getattr(p, SHARD_ATTR).home)
                self.gathered[id(p)] = p
        finally:
            self._busy = False

    @torch.no_grad()
    def _shard_gathered(self, keep: set[int]) -> None:
        self._busy = True
        try:
            for k in [k for k in self.gathered if k not in keep]:
                self._cut(self.gathered.pop(k))
        finally:
            self._busy = False

    @torch.no_grad()
    def full_value(self, p: nn.Parameter) -> torch.Tensor:
        """The whole value of a parameter on the shard device: gathered from the ranks' pieces if sharded, else
        rank 0's value (collective)."""
        record: ConstructionShard | None = getattr(p, SHARD_ATTR, None)
        if record is None:
            value = p.data.to(self.device, dtype=self.dtype if self.dtype is not None and p.is_floating_point()
                              else p.dtype, copy=True)
            self.comm.broadcast(value, src_group_rank=0)
            return value
        out = torch.empty(record.shard.numel() * self.comm.size, dtype=record.shard.dtype, device=self.device)
        self.comm.all_gather_into_tensor(out, record.shard)
        return out[:record.numel].view(record.shape)


@torch.no_grad()
def partition_constructed(model: nn.Module, sharder: ConstructionSharder, *, persistence_threshold: int,
                          model_persistence_threshold: int) -> Partition:
    """Lay a model built in the block out as ZeRO-3 units: one parameter whole at a time (gathered from the
    construction pieces), its unit piece kept; persistent parameters whole on every rank; buffers moved to the
    shard device. The model's parameters are placeholders afterwards, as `materialize_sharded` leaves them."""
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise UserError(f"zero.Init: parameter {name} of the model built in the block is still on the meta "
                            f"device (built under torch.device('meta') and never given values): build it with real "
                            f"tensors in the block, or build it whole and call zero.Init(module=model)")

    def shape_of(p: nn.Parameter) -> torch.Size:
        record: ConstructionShard | None = getattr(p, SHARD_ATTR, None)
        return record.shape if record is not None else p.shape

    comm, device = sharder.comm, sharder.device
    plans, persistent = plan_units(model, persistence_threshold=persistence_threshold,
                                   model_persistence_threshold=model_persistence_threshold, shape_of=shape_of)

    def dtype_of(p: nn.Parameter) -> torch.dtype:
        record: ConstructionShard | None = getattr(p, SHARD_ATTR, None)
        if record is not None:
            return record.shard.dtype
        return sharder.dtype if sharder.dtype is not None and p.is_floating_point() else p.dtype

    units = []
    for index, plan in enumerate(plans):
        # one unit's shards at a time, each parameter's construction piece freed once copied: beside the pieces,
        # a rank holds one unit's new shard and one whole parameter (the engine re-keys the flats and adds grads)
        (unit,) = build_units([plan], key_of=lambda p: FlatKey(0 if p.requires_grad else None, dtype_of(p)),
                              shape_of=shape_of, dp_size=comm.size, dp_rank=comm.rank, device=device,
                              grad_shards=False)
        unit.index = index
        for flat in unit.flats:
            flat.unit = index
            for i, p in enumerate(flat.params):
                flat.copy_piece(i, sharder.full_value(p))
                p.data = flat.empty
                _forget(p)
        units.append(unit)
    for p in persistent:
        p.data = sharder.full_value(p)
        _forget(p)
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(device)
    return Partition(units, persistent, comm.size, comm.rank, persistence_threshold, model_persistence_threshold)


def _forget(p: nn.Parameter) -> None:
    if hasattr(p, SHARD_ATTR):
        delattr(p, SHARD_ATTR)

