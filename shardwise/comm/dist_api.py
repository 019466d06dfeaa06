"""DeepSpeed's module-level `deepspeed.comm` functions, for scripts: `shardwise.comm.get_rank()` etc.

They act on torch.distributed's default group unless given `group=` (that is their contract in DeepSpeed too);
shardwise's own code passes `Comm`s instead and never calls these. DeepSpeed's profiling keywords (`prof`,
`log_name`, `debug`) are accepted and change nothing: shardwise's comms logger reads the ledger of the engine's own
collectives, and these are the script's.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from shardwise.errors import UserError


ReduceOp = dist.ReduceOp


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int | None = None, verbose: bool = True, timeout: Any = None,
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config: Any = None, rank: int = -1, world_size: int = -1) -> None:
    """DeepSpeed's `init_distributed`: join the job from the launcher's environment (torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR...), or through an explicit rendezvous (`init_method`, `rank`, `world_size`, as
    torch.distributed.init_process_group takes them), or make a world of one; idempotent. A group the script made
    itself is kept. `dist_init_required=False` promises that one exists: without it this refuses, as DeepSpeed's
    does. MPI discovery, the port and verbosity are DeepSpeed's launcher concerns and change nothing here."""
    if dist_init_required is False:
        if not is_initialized():
            raise UserError("init_distributed(dist_init_required=False) but torch.distributed is not initialized: "
                            "pass dist_init_required=True (or leave it None), or call "
                            "torch.distributed.init_process_group first")
        return
    from shardwise.engine.initialize import init_distributed as _init
    _init(dist_backend, timeout_s=timeout.total_seconds() if timeout is not None else None,
          init_method=init_method, rank=rank, world_size=world_size)


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks: list[int]) -> Any:
    return dist.new_group(ranks)


def get_world_group() -> Any:
    return dist.group.WORLD


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """The rank on this node: the launcher's LOCAL_RANK (0 for a single process), as DeepSpeed reads it."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    if group is None:
        return list(range(get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **_profiling: Any) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False,
                      **_profiling: Any) -> Any:
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               **_profiling: Any) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                         **_profiling: Any) -> Any:
    """DeepSpeed's low-latency all-reduce for inference; the backend's all-reduce gives the same sums.

    gloo has no 16-bit sums: there the tensor is summed in fp32 and cast back (exact for the integer-valued
    sums a rank count makes, and within one rounding of the 16-bit format otherwise)."""
    if tensor.dtype in (torch.float16, torch.bfloat16) and dist.get_backend(group) == "gloo":
        wide = tensor.float()
        work = dist.all_reduce(wide, op=op, group=group)
        tensor.copy_(wide)
        return work
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                         async_op: bool = False, **_profiling: Any) -> Any:
    works = [dist.all_reduce(t, op=op, group=group, async_op=async_op) for t in tensors]
    return works if async_op else None


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           **_profiling: Any) -> Any:
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **_profiling: Any) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None,
                          **_profiling: Any) -> None:
    dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False, **_profiling: Any) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, **_profiling: Any) -> None:
    dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, **_profiling: Any) -> Any:
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                 async_op: bool = False, **_profiling: Any) -> Any:
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather_coalesced(output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], group: Any = None,
                         async_op: bool = False) -> Any:
    works = [dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
             for out, inp in zip(output_tensors, input_tensors)]
    return works if async_op else None


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, **_profiling: Any) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                      group: Any = None, async_op: bool = False, **_profiling: Any) -> Any:
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False, **_profiling: Any) -> Any:
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False,
                      **_profiling: Any) -> Any:
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: Any = None,
               async_op: bool = False, **_profiling: Any) -> Any:
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_profiling: Any) -> None:
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_profiling: Any) -> int:
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_profiling: Any) -> Any:
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_profiling: Any) -> Any:
    return dist.irecv(tensor, src, group=group, tag=tag)


def batch_isend_irecv(p2p_op_list: list[Any], **_profiling: Any) -> list[Any]:
    return dist.batch_isend_irecv(p2p_op_list)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False, **_profiling: Any) -> Any:
    return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False, **_profiling: Any) -> Any:
    return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)
