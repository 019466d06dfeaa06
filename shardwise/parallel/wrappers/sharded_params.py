"""What a module wrapped by `fully_shard` holds as its parameters, as FSDP2's: while a unit is sharded, each of its
parameters is a DTensor (Shard(0) over the dp mesh) whose local tensor is this rank's rows of the shard, and its
`.grad` a DTensor of the same rows of the averaged gradient; while the unit is gathered (its forward and backward),
the module holds the plain whole parameter autograd works with.

Why: code that reads the parameters then sees the whole model. `torch.nn.utils.clip_grad_norm_(model.parameters())`
sums the shards' squares over the group, `torch.distributed.checkpoint` writes every rank's rows, and DTensor-aware
code reads global shapes. The optimizer steps the DTensors, whose local tensors view the shard: in place, no copy.

Two parameter objects per model parameter, sharing storage:

    inner    the plain nn.Parameter of the ZeRO-3 unit (`FlatShard.params`): .data is the gathered view
             [shape] while the unit is gathered, its piece of the shard [rows, *shape[1:]] while it is sharded.
             Autograd accumulates into it; the runtime's hooks reduce-scatter its gradient into grad_shard.
    shown    the DTensor nn.Parameter over the same piece (what `model.parameters()` yields at rest, and what an
             optimizer built after wrapping steps), placed by `placement`: Shard(0) over the dp mesh, or on the
             (dp, tp) mesh for a model split by `shardwise.parallelize_module` over a DeviceMesh. A 0-dim
             parameter (one row, on rank 0) has no Shard(0) placement: it is shown as its inner parameter; so is
             every parameter under a tp group known only as a process group (shardwise's `ParallelMesh`).

Gradients as on one process: a parameter shows a gradient only once a backward reached it since the last time
its `.grad` was set to None (`optimizer.zero_grad()`), so a submodule that a backward did not reach keeps None
and the optimizer leaves it alone (FSDP2's and torch's rule). Every rank is expected to reach the same
parameters, as for FSDP2; the reduce-scatters stay uniform either way (a flat without gradients sends zeros).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.parallel.tensor_parallel.layers import TP_DIM_ATTR, TP_MESH_ATTR
from shardwise.parallel.wrappers.dtensors import local_of
from shardwise.parallel.wrappers.torch_tp import TORCH_TP_ATTR
from shardwise.parallel.zero.flat import FlatKey, FlatShard, _resize

SlotList = list[tuple[nn.Module, str]]
"""Where one parameter is registered: (module, attribute name), several for a shared parameter."""


def param_slots(module: nn.Module) -> dict[int, SlotList]:
    """id(parameter) -> every (module, name) under `module` that registers it."""
    slots: dict[int, SlotList] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((m, name))
    return slots


def _set_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """nn.Module.__setattr__'s checks cost more than the swap itself; a module that overrides it gets it."""
    if type(module).__setattr__ is nn.Module.__setattr__:
        module._parameters[name] = param
    else:
        setattr(module, name, param)


@dataclass(frozen=True)
class Placed:
    """How a parameter is shown as a DTensor: on `mesh` (the dp mesh, or the (dp, tp) mesh), with `placements`,
    of the whole model's `shape`; its local tensor is always this rank's rows of the shard."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]

    def dtensor(self, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor
        size = torch.Size(self.shape)
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=size,
                                  stride=torch.empty(size, device="meta").stride())

    def tp_slice(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's TP slice of the whole model's tensor (the parameter's inner shape), on a (dp, tp) mesh."""
        from torch.distributed.tensor import Shard
        for at, p in enumerate(self.placements):
            if type(p) is Shard and self.mesh.mesh_dim_names[at] == "tp":
                n = whole.shape[p.dim] // self.mesh.size(at)
                return whole.narrow(p.dim, self.mesh.get_local_rank(at) * n, n)
        return whole

    def matches(self, value: Any) -> bool:
        """`value` (a DTensor) is laid out as this: its local tensor is this rank's rows."""
        return (tuple(value.placements) == tuple(self.placements) and value.device_mesh == self.mesh
                and tuple(value.shape) == tuple(self.shape))


def placement(mesh: Any, shape: tuple[int, ...], *, tp_mesh: Any = None, tp_dim: int | None = None,
              dim: int = 0) -> Placed | None:
    """How a parameter of `shape` (a TP slice under tensor parallelism) is shown: Shard(0) over `mesh` (the dp
    mesh), or on the (dp, tp) mesh above both `mesh` and `tp_mesh`: dim-0 rows over dp, and over tp Shard(tp_dim)
    for a TP slice cut along `tp_dim`, Replicate for a parameter every TP rank holds whole. A TP slice cut along
    dim 0 is cut again along dim 0 over dp: the dp placement is then torch's _StridedShard (FSDP2's, with TP), the
    rows of each TP slice being split before those of the next. None for a 0-dim parameter (no Shard(0)).
    `dim`: Shard(dim) over dp for a parameter `fully_shard` cuts along another dim (no TP)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    if not shape or mesh is None:
        return None
    if tp_mesh is None:
        return Placed(mesh, (Shard(dim),), tuple(shape))
    root = tp_mesh._get_root_mesh()
    names = root.mesh_dim_names or ()
    dp_at, tp_at = names.index(mesh.mesh_dim_names[0]), names.index(tp_mesh.mesh_dim_names[0])
    tp = tp_mesh.size()
    placements: list[Any] = [None, None]
    placements[tp_at] = Replicate() if tp_dim is None else Shard(tp_dim)
    placements[dp_at] = _StridedShard(0, split_factor=tp) if tp_dim == 0 and tp_at > dp_at else Shard(0)
    whole = list(shape)
    if tp_dim is not None:
        whole[tp_dim] *= tp
    return Placed(root, tuple(placements), tuple(whole))


@dataclass(eq=False)
class ShownFlat(FlatShard):
    """A wrapper's flat: the parameters its module holds while sharded (`shown`), swapped for the inner ones while
    gathered, and which parameters a backward reached (`reached`)."""

    shown: list[nn.Parameter] = field(default_factory=list)
    specs: list[Placed | None] = field(default_factory=list)
    slots: list[SlotList] = field(default_factory=list)
    shown_grads: list[torch.Tensor | None] = field(default_factory=list)
    """Per parameter, the `.grad` it shows when reached: its piece of grad_shard (a DTensor when shown as one),
    made once; None for a flat the optimizer does not step."""
    reached: list[bool] = field(default_factory=list)

    def present(self, specs: list[Placed | None], slots: dict[int, SlotList], sharded_attr: str) -> None:
        """Make the shown parameters (DTensors placed by `specs[i]`, or the inner ones where it is None) and hold
        them in the module. Call after the shard (and grad_shard) reached their final tensors."""
        pieces, grads = self.shard_pieces()
        self.specs = list(specs)
        self.shown, self.shown_grads, self.reached = [], [], [False] * len(self.params)
        self.slots = [slots.get(id(p), []) for p in self.params]
        for i, p in enumerate(self.params):
            spec, g = specs[i], grads[i]
            if spec is None:
                shown, grad = p, g
            else:
                shown = nn.Parameter(spec.dtensor(pieces[i]), requires_grad=p.requires_grad)
                grad = None if g is None else spec.dtensor(g)
            setattr(shown, sharded_attr, True)
            for attr in (TP_DIM_ATTR, TP_MESH_ATTR):     # what a wrapping further up reads of the parameter
                if hasattr(p, attr):
                    setattr(shown, attr, getattr(p, attr))
            self.shown.append(shown)
            self.shown_grads.append(grad)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._reach(i))
        self._hold(self.shown)

    def _reach(self, i: int) -> None:
        self.reached[i] = True

    def _hold(self, params: list[nn.Parameter]) -> None:
        for slots, p in zip(self.slots, params):
            for module, name in slots:
                _set_param(module, name, p)

    def attach(self) -> None:
        super().attach()
        if self.shown:
            # a layer of torch's TP computes on a DTensor over the gathered TP slice (`torch_tp.py`)
            self._hold([p if (tp := getattr(p, TORCH_TP_ATTR, None)) is None else tp.forward_tensor(p)
                        for p in self.params])

    def release(self) -> None:
        if not self.shown:              # not presented yet (wrapping in progress): the plain pieces
            super().release()
            return
        pieces, _ = self.shard_pieces()
        for p, v in zip(self.params, pieces):
            p.data = v
        for i, shown in enumerate(self.shown):      # none before the first reduction, as before a first backward
            shown.grad = self.shown_grads[i] if self.reached[i] and self.has_grads else None
        self._hold(self.shown)
        if self.full is not None:
            _resize(self.full, 0)

    @torch.no_grad()
    def _take_back_grads(self) -> None:
        """Before a gather: what the user did to the shown gradients goes into grad_shard (None, what
        `zero_grad()` leaves: its piece is zeroed and the parameter counts as not reached; a replaced tensor is
        copied in); the inner parameters' .grad is cleared so that autograd accumulates this backward's afresh."""
        if not self.shown:
            super()._take_back_grads()
            return
        pieces = self.local_views(self.grad_shard) if self.grad_shard is not None else [None] * len(self.params)
        for i, shown in enumerate(self.shown):
            piece, grad = pieces[i], shown.grad
            if piece is None:
                continue
            if grad is None:
                piece.zero_()
                self.reached[i] = False
                continue
            self.reached[i] = True
            local = local_of(grad)
            if local.data_ptr() != piece.data_ptr() or local.shape != piece.shape:
                piece.copy_(local)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def adopt_converted(self) -> bool:
        """After nn.Module's `_apply` (`model.to(torch.float64)`, `.double()`, `.to(device)`) converted the shown
        parameters (DTensors are swapped whole, so their local tensors no longer view the shard): a new shard [S]
        of their dtype and device holds their values, and they view it again, as do the inner parameters; the
        gradient shard follows. Call while the flat is released. Returns whether anything changed."""
        if not self.shown:
            return False
        locals_ = [local_of(s) if spec is not None else s.data for s, spec in zip(self.shown, self.specs)]
        storage = self.shard.untyped_storage().data_ptr()
        if all(t.dtype == self.shard.dtype and t.device == self.shard.device
               and (t.numel() == 0 or t.untyped_storage().data_ptr() == storage) for t in locals_):
            return False
        dtype, device = locals_[0].dtype, locals_[0].device
        shard = torch.zeros(self.shard.shape, dtype=dtype, device=device)                      # [S]
        for piece, value in zip(self.local_views(shard), locals_):
            piece.copy_(value)
        self.shard, self.key = shard, FlatKey(self.key.group, dtype)
        self.empty = torch.empty(0, dtype=dtype, device=device)
        if self.grad_shard is not None:
            self.grad_shard = self.grad_shard.to(device, dtype)
        if self.full is not None:           # the next gather allocates it in the new dtype
            self.full, self.views = None, []
        pieces, grads = self.shard_pieces()
        for i, (p, shown, spec) in enumerate(zip(self.params, self.shown, self.specs)):
            p.data = pieces[i]
            if spec is None:
                self.shown_grads[i] = grads[i]
            else:
                # the DTensor's own metadata is already the converted one: only its local tensor moves
                setattr(shown, "_local_tensor", pieces[i])
                grad = grads[i]
                self.shown_grads[i] = None if grad is None else spec.dtensor(grad)
            shown.grad = self.shown_grads[i] if self.reached[i] and self.has_grads else None
        return True
