"""A whole state dict read on rank 0 only, sent to the other ranks of the data-parallel group: torch's
`StateDictOptions(broadcast_from_rank0=True)`. Only rank 0 reads the file; the others pass empty dicts.

Rank 0 sends the dict's shape first (keys, nesting, plain values, and each tensor's shape and dtype) as one
object. Every other rank builds empty tensors from it, and the tensors follow in one broadcast per dtype (and per
250 MiB), as the DDP wrapper sends its buffers. Each rank then holds the whole dict, as if it had read the file
itself, and the usual full load keeps its part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was: its shape and dtype (the values follow in the broadcasts)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_from_rank0(comm, trees: list[Any]) -> list[Any]:
    """`trees` as rank 0 of `comm` holds them, on every rank (collective; the others' `trees` are ignored).
    Tensors arrive on the host over gloo, on this rank's GPU over NCCL alone."""
    if comm.local:
        return trees
    device = torch.device("cpu") if comm.carries_host_tensors else torch.device("cuda", torch.cuda.current_device())
    told = None
    if comm.rank == 0:
        leaves, spec = tree_flatten(trees)
        told = ([_Slot(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    shape, spec = comm.all_gather_object(told)[0]
    if comm.rank == 0:
        tensors = [x.detach().to(device) for x in leaves if isinstance(x, torch.Tensor)]
    else:
        tensors = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in shape if isinstance(s, _Slot)]
    comm.broadcast_coalesced(tensors)
    arrived = iter(tensors)
    return tree_unflatten([next(arrived) if isinstance(s, _Slot) else s for s in shape], spec)


def dp_comm(model: torch.nn.Module, target):
    """The group over which the model's replicas or shards live: the wrapper's, else every rank."""
    if target.sharded is not None:
        return target.sharded._fully_shard_state().groups.dp
    groups = getattr(model, "groups", None)          # the DDP wrapper's
    if groups is not None:
        return groups.dp
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    return Comm(None, CommLedger(), name="dp")
