"""DeepSpeed's module-level `deepspeed.comm` functions, for scripts: `shardwise.comm.get_rank()` etc.

They act on torch.distributed's default group unless given `group=` (that is their contract in DeepSpeed too);
shardwise's own code passes `Comm`s instead and never calls these.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


ReduceOp = dist.ReduceOp


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int | None = None, verbose: bool = True, timeout: Any = None,
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config: Any = None, rank: int = -1, world_size: int = -1) -> None:
    """DeepSpeed's `init_distributed`: join the job from the launcher's environment (torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR...), or through an explicit rendezvous (`init_method`, `rank`, `world_size`, as
    torch.distributed.init_process_group takes them), or make a world of one; idempotent.
    `dist_init_required=False` leaves torch.distributed alone, as in DeepSpeed. MPI discovery, the port and
    verbosity are DeepSpeed's launcher concerns and change nothing here."""
    if dist_init_required is False:
        return
    from shardwise.engine.initialize import init_distributed as _init
    _init(dist_backend, timeout_s=timeout.total_seconds() if timeout is not None else None,
          init_method=init_method, rank=rank, world_size=world_size)


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """The rank on this node: the launcher's LOCAL_RANK (0 for a single process), as DeepSpeed reads it."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
