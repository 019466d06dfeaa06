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
             optimizer built after wrapping steps). A 0-dim parameter (one row, on rank 0) has no Shard(0)
             placement: it is shown as its inner parameter; so is every parameter under a (dp, tp) mesh, whose
             TP slices this module does not place.

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

from shardwise.parallel.wrappers.dtensors import local_of
from shardwise.parallel.zero.flat import FlatShard, _resize

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


@dataclass(eq=False)
class ShownFlat(FlatShard):
    """A wrapper's flat: the parameters its module holds while sharded (`shown`), swapped for the inner ones while
    gathered, and which parameters a backward reached (`reached`)."""

    shown: list[nn.Parameter] = field(default_factory=list)
    slots: list[SlotList] = field(default_factory=list)
    shown_grads: list[torch.Tensor | None] = field(default_factory=list)
    """Per parameter, the `.grad` it shows when reached: its piece of grad_shard (a DTensor when shown as one),
    made once; None for a flat the optimizer does not step."""
    reached: list[bool] = field(default_factory=list)

    def present(self, mesh: Any, slots: dict[int, SlotList], sharded_attr: str) -> None:
        """Make the shown parameters (DTensors over `mesh`, or the inner ones where `mesh` is None) and hold
        them in the module. Call after the shard (and grad_shard) reached their final tensors."""
        pieces, grads = self.shard_pieces()
        self.shown, self.shown_grads, self.reached = [], [], [False] * len(self.params)
        self.slots = [slots.get(id(p), []) for p in self.params]
        for i, p in enumerate(self.params):
            if mesh is None or not self.shapes[i]:
                shown, grad = p, grads[i]
            else:
                shown = nn.Parameter(self._dtensor(mesh, i, pieces[i]), requires_grad=p.requires_grad)
                g = grads[i]
                grad = None if g is None else self._dtensor(mesh, i, g)
            setattr(shown, sharded_attr, True)
            self.shown.append(shown)
            self.shown_grads.append(grad)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._reach(i))
        self._hold(self.shown)

    def _dtensor(self, mesh: Any, i: int, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard
        shape = torch.Size(self.shapes[i])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)

    def _reach(self, i: int) -> None:
        self.reached[i] = True

    def _hold(self, params: list[nn.Parameter]) -> None:
        for slots, p in zip(self.slots, params):
            for module, name in slots:
                _set_param(module, name, p)

    def attach(self) -> None:
        super().attach()
        if self.shown:
            self._hold(self.params)

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

    def inner_of(self) -> dict[int, int]:
        """id(shown parameter) -> its index here (the inner parameters included)."""
        out = {id(p): i for i, p in enumerate(self.params)}
        out.update({id(s): i for i, s in enumerate(self.shown)})
        return out
