"""A whole state dict read on rank 0 only, sent to the other ranks of the data-parallel group: torch's
`StateDictOptions(broadcast_from_rank0=True)`. Only rank 0 reads the file; the others pass empty dicts.

Rank 0 sends the dict's shape first (keys, nesting, plain values, and each tensor's shape and dtype) as one
object. Every other rank builds empty tensors from it, and the tensors follow in one broadcast per dtype (and per
250 MiB), as the DDP wrapper sends its buffers. Each rank then holds the whole dict, as if it had read the file
itself, and the usual full load keeps its part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was: its shape and dtype (the values follow in the broadcasts)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _skeleton(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return _Slot(tuple(tree.shape), tree.dtype)
    if isinstance(tree, dict):
        return {k: _skeleton(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_skeleton(v, tensors) for v in tree)
    return tree


def _fill(skeleton: Any, tensors: Iterator[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        return next(tensors)
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return skeleton


def broadcast_from_rank0(comm, trees: list[Any]) -> list[Any]:
    """`trees` as rank 0 of `comm` holds them, on every rank (collective; the others' `trees` are ignored).
    Tensors arrive on the host over gloo, on this rank's GPU over NCCL alone."""
    from shardwise.parallel.wrappers.ddp import broadcast_coalesced
    if comm.local:
        return trees
    device = torch.device("cpu") if comm.carries_host_tensors else torch.device("cuda", torch.cuda.current_device())
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(trees, tensors) if comm.rank == 0 else None
    skeleton = comm.all_gather_object(skeleton)[0]
    if comm.rank == 0:
        tensors = [t.detach().to(device) for t in tensors]
    else:
        slots: list[_Slot] = []
        _collect(skeleton, slots)
        tensors = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in slots]
    broadcast_coalesced(comm, tensors)
    return _fill(skeleton, iter(tensors))


def _collect(skeleton: Any, slots: list[_Slot]) -> None:
    if isinstance(skeleton, _Slot):
        slots.append(skeleton)
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _collect(v, slots)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            _collect(v, slots)


def dp_comm(model: torch.nn.Module, target):
    """The group over which the model's replicas or shards live: the wrapper's, else every rank."""
    if target.sharded is not None:
        return target.sharded._sharded_group().groups.dp
    groups = getattr(model, "groups", None)          # the DDP wrapper's
    if groups is not None:
        return groups.dp
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    return Comm(None, CommLedger(), name="dp")
