"""Sharded state dicts as FSDP2 gives them: each sharded parameter (and optimizer state laid out like it) as a
`DTensor` over the data-parallel group, Shard(0), whose local tensor is this rank's rows. Why: DCP
(`torch.distributed.checkpoint`, and what is built on it: torchtitan's checkpointer, resharding on load) writes a
plain tensor from one rank only, as if replicated, so the other ranks' rows would be lost; a DTensor tells it the
global shape and where each rank's rows lie, so it writes every piece and loads at any other world size.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Iterator

import torch
from torch import nn

PLAIN_ATTR = "_shardwise_plain_state_dict"
"""Set on a `FullyShardState` while the wrappers read their own state dicts: plain tensors, no collective."""


def is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(value, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (this rank's rows); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def dp_device_mesh(groups, device: torch.device) -> Any | None:
    """The 1-D DeviceMesh over the dp ranks of `groups` (a `DataParallelGroups`), on `device`'s type; None under a
    (dp, tp) mesh, whose parameters each carry their own 2-D placement (`sharded_params.placement`), or stay
    plain under a `ParallelMesh`."""
    if groups.tp.size != 1:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    group = groups.dp.group or dist.group.WORLD
    assert group is not None        # groups_of refused to wrap before the process group was initialized
    return DeviceMesh.from_group(group, device.type)


def dp_mesh(sharding) -> Any | None:
    """The DeviceMesh the sharded parameters of `sharding` (a `FullyShardState`) are DTensors on, or None."""
    return sharding.mesh


@contextlib.contextmanager
def plain_state_dicts(sharding) -> Iterator[None]:
    """The wrappers' own reads of `state_dict()`: this rank's plain tensors, without the DTensor hook."""
    before = getattr(sharding, PLAIN_ATTR, False)
    setattr(sharding, PLAIN_ATTR, True)
    try:
        yield
    finally:
        setattr(sharding, PLAIN_ATTR, before)


def to_dtensor(sharding, flat, i: int, local: torch.Tensor) -> torch.Tensor:
    """`local`, laid out as this rank holds parameter i of `flat` (its rows), as a DTensor of the whole parameter.

    `RowLayout` cuts dim 0 into ceil(d0 / W) rows per rank, the last ranks possibly holding fewer or none:
    `torch.chunk`'s rule, which is also Shard(0)'s, so `local` is used as it is (no copy, no communication). A
    0-dim parameter lives on rank 0 only; its entry is a Replicate DTensor of rank 0's value, broadcast, which
    makes `state_dict()` collective for a model with a scalar parameter (DCP calls it on every rank)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    spec = placed(flat, i)
    if spec is not None:            # as the parameter itself is shown (`sharded_params.placement`)
        return spec.dtensor(local)
    mesh = dp_mesh(sharding)
    shape = tuple(flat.shapes[i])
    if not shape:                   # a scalar: rank 0's value, everywhere
        value = local.detach().reshape(()) if local.numel() else torch.zeros((), dtype=local.dtype,
                                                                               device=local.device)
        value = value.clone()
        sharding.groups.dp.broadcast(value)
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)


def placed(flat, i: int) -> Any:
    """How parameter i of `flat` is shown as a DTensor (`sharded_params.Placed`), or None (plain rows)."""
    specs = getattr(flat, "specs", None)
    return specs[i] if specs else None


def to_local(sharding, flat, i: int, value: Any) -> Any:
    """A loaded entry of parameter i of `flat` as this rank holds it (its rows): a DTensor's local tensor when it
    is laid out as ours, else its whole value cut (to this rank's TP slice on a (dp, tp) mesh, then
    `rank_piece`); anything else (a plain tensor) as it is."""
    if not is_dtensor(value):
        return value
    from torch.distributed.tensor import Shard
    from shardwise.parallel.wrappers.module import rank_piece
    spec = placed(flat, i)
    if spec is not None and spec.matches(value):
        return value.to_local()
    if spec is not None and spec.mesh.ndim == 2:
        return rank_piece(flat, i, spec.tp_slice(value.full_tensor()))
    mesh = value.device_mesh
    if tuple(flat.shapes[i]) and tuple(value.placements) == (Shard(0),) and mesh.ndim == 1 \
            and mesh.size() == sharding.groups.dp.size and mesh.get_local_rank() == sharding.groups.dp.rank:
        return value.to_local()
    return rank_piece(flat, i, value.full_tensor())


def rows_of(sharding, module: nn.Module, state: dict[str, Any], prefix: str = "") -> None:
    """In place: each sharded parameter's DTensor entry in `state` (named under `prefix`) as this rank's rows."""
    where = sharding.where()
    for name, p in module.named_parameters(prefix=prefix, remove_duplicate=False):
        if id(p) in where and is_dtensor(state.get(name)):
            flat, i = where[id(p)]
            state[name] = to_local(sharding, flat, i, state[name])


def as_shown(sharding, module: nn.Module, state: dict[str, Any], prefix: str = "") -> None:
    """In place: each entry of a parameter the module holds as a DTensor (`sharded_params.py`), given as this
    rank's rows or as the whole value (plain tensors: `rows_of` ran), as a DTensor over this rank's rows, which
    `load_state_dict` copies into the parameter's rows. The ZeRO-3 runtime's own load hook skips these."""
    from shardwise.parallel.wrappers.module import rank_piece
    where = sharding.where()
    for name, p in module.named_parameters(prefix=prefix, remove_duplicate=False):
        value = state.get(name)
        if id(p) not in where or not is_dtensor(p) or not isinstance(value, torch.Tensor) or is_dtensor(value):
            continue
        flat, i = where[id(p)]
        local = flat.layout.local_shape(i, flat.rank)
        if tuple(value.shape) != tuple(local) and tuple(value.shape) == tuple(flat.shapes[i]):
            value = rank_piece(flat, i, value)
        elif tuple(value.shape) != tuple(local):
            continue                # torch's load_state_dict names the entry and both shapes
        state[name] = to_dtensor(sharding, flat, i, value.to(p.device))


def install(module: nn.Module, state_of) -> None:
    """State-dict hooks on a module `fully_shard` wrapped: out, its sharded parameters as DTensors; in, DTensors
    back to this rank's rows. `state_of(module)` is its current `FullyShardState` (the root's, once wrapped above)."""

    def out(m: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        sharding = state_of(m)
        if getattr(sharding, PLAIN_ATTR, False):          # the parameters held as DTensors: their rows
            for name, value in state.items():
                if is_dtensor(value) and name.startswith(prefix):
                    state[name] = value.to_local()
            return
        if dp_mesh(sharding) is None:
            return
        where = sharding.where()
        for name, p in m.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            if id(p) in where and name in state and not is_dtensor(state[name]):
                flat, i = where[id(p)]
                state[name] = to_dtensor(sharding, flat, i, state[name])

    def into(m: nn.Module, state: dict[str, Any], prefix: str, *_rest: Any) -> None:
        sharding = state_of(m)
        rows_of(sharding, m, state, prefix.rstrip("."))
        as_shown(sharding, m, state, prefix.rstrip("."))

    module.register_state_dict_post_hook(out)
    handle = module.register_load_state_dict_pre_hook(into)
    # ahead of the ZeRO-3 runtime's own pre-hook, which takes an entry of the whole shape for a whole value (torch
    # keeps the hooks in an OrderedDict; its stubs say dict, which has no move_to_end)
    hooks = module._load_state_dict_pre_hooks
    assert isinstance(hooks, OrderedDict)
    hooks.move_to_end(handle.id, last=False)


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
