"""Sharded state dicts as FSDP2 gives them: each sharded parameter (and optimizer state laid out like it) as a
`DTensor` over the data-parallel group, Shard(0), whose local tensor is this rank's rows.

Why: `torch.distributed.checkpoint` (and everything built on it: torchtitan's checkpointer, DCP's resharding on
load) treats a plain tensor as replicated and writes it from one rank only. This rank's rows under the parameter's
name would be saved from one rank and the others' rows lost. A DTensor tells DCP the global shape and where
each rank's rows lie, so it writes every piece and loads any other world size's.

Our `RowLayout` cuts dim 0 into ceil(d0 / W) rows per rank, the last ranks possibly holding fewer or none:
`torch.chunk`'s rule, which is also Shard(0)'s. So the local tensor is used as it is (no copy, no
communication). A 0-dim parameter lives on rank 0 only; its entry is a Replicate DTensor of rank 0's value. That
broadcast makes `state_dict()` collective for a model with a scalar parameter, as DCP calls it: on every rank.

Not converted (plain local tensors, as before): wrappers over a (dp, tp) mesh, whose parameters are TP slices
sharded again over dp (a 2-D placement this module does not build).

Loading takes DTensors or plain tensors. A DTensor laid out as this rank's rows gives its local tensor, and any
other layout gives its whole value cut to this rank's rows (`rank_piece`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

PLAIN_ATTR = "_shardwise_plain_state_dict"
"""Set on a `ShardedGroup` while the wrappers read their own state dicts: plain tensors, no collective."""


def is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(value, DTensor)


def dp_mesh(group) -> Any | None:
    """The 1-D DeviceMesh over `group`'s dp ranks (built once), or None when its entries stay plain tensors."""
    mesh = getattr(group, "_dtensor_mesh", False)
    if mesh is not False:
        return mesh
    mesh = None
    if group.groups.tp.size == 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        flats = group.runtime.partition.flats
        device = flats[0].compute_device or flats[0].shard.device if flats else torch.device("cpu")
        mesh = DeviceMesh.from_group(group.groups.dp.group or dist.group.WORLD, device.type)
    group._dtensor_mesh = mesh
    return mesh


@contextlib.contextmanager
def plain_state_dicts(group) -> Iterator[None]:
    """The wrappers' own reads of `state_dict()`: this rank's plain tensors, without the DTensor hook."""
    before = getattr(group, PLAIN_ATTR, False)
    setattr(group, PLAIN_ATTR, True)
    try:
        yield
    finally:
        setattr(group, PLAIN_ATTR, before)


def to_dtensor(group, flat, i: int, local: torch.Tensor) -> torch.Tensor:
    """`local`, laid out as parameter i of `flat` rests on this rank, as a DTensor of the whole parameter."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = dp_mesh(group)
    shape = tuple(flat.shapes[i])
    if not shape:                   # a scalar: rank 0's value, everywhere
        value = local.detach().reshape(()) if local.numel() else torch.zeros((), dtype=local.dtype,
                                                                               device=local.device)
        value = value.clone()
        group.groups.dp.broadcast(value)
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)


def to_local(group, flat, i: int, value: Any) -> Any:
    """A loaded entry of parameter i of `flat` as it rests on this rank: a DTensor's rows (its local tensor when
    it is laid out as ours, else its whole value cut); anything else as it is."""
    if not is_dtensor(value):
        return value
    from torch.distributed.tensor import Shard
    from shardwise.parallel.wrappers.module import rank_piece
    mesh = value.device_mesh
    if tuple(flat.shapes[i]) and tuple(value.placements) == (Shard(0),) and mesh.ndim == 1 \
            and mesh.size() == group.groups.dp.size and mesh.get_local_rank() == group.groups.dp.rank:
        return value.to_local()
    return rank_piece(flat, i, value.full_tensor())


def rows_of(group, module: nn.Module, state: dict[str, Any], prefix: str = "") -> None:
    """In place: each sharded parameter's DTensor entry in `state` (named under `prefix`) as this rank's rows."""
    where = group.runtime.partition.where()
    for name, p in module.named_parameters(prefix=prefix, remove_duplicate=False):
        if id(p) in where and is_dtensor(state.get(name)):
            flat, i = where[id(p)]
            state[name] = to_local(group, flat, i, state[name])


def install(module: nn.Module, group_of) -> None:
    """State-dict hooks on a module `fully_shard` wrapped: out, its sharded parameters as DTensors; in, DTensors
    back to this rank's rows. `group_of(module)` is its current `ShardedGroup` (the root's, once wrapped above)."""

    def out(m: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        group = group_of(m)
        if getattr(group, PLAIN_ATTR, False) or dp_mesh(group) is None:
            return
        where = group.runtime.partition.where()
        for name, p in m.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            if id(p) in where and name in state and not is_dtensor(state[name]):
                flat, i = where[id(p)]
                state[name] = to_dtensor(group, flat, i, state[name])

    def into(m: nn.Module, state: dict[str, Any], prefix: str, *_rest: Any) -> None:
        rows_of(group_of(m), m, state, prefix.rstrip("."))

    module.register_state_dict_post_hook(out)
    handle = module.register_load_state_dict_pre_hook(into)
    # ahead of the ZeRO-3 runtime's own pre-hook, which takes an entry of the whole shape for a whole value
    module._load_state_dict_pre_hooks.move_to_end(handle.id, last=False)


@torch.no_grad()
def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """An optimizer that has not stepped yet holds no state, so its state dict is no template for
    `torch.distributed.checkpoint.load` to fill. As torch's `get_state_dict` does: one step on zero gradients with
    every lr at 0 (the parameters do not move; weight decay is scaled by lr), then the gradients are dropped."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params):
        return                  # gradients of a step under way: leave them, and the state, alone
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optim.param_groups if "lr" in g]
    for g in optim.param_groups:
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for g, lr in zip([g for g in optim.param_groups if "lr" in g], lrs):
            g["lr"] = lr
        for p in params:
            p.grad = None
