"""Communication: every collective goes through a `Comm` (a process group plus its `CommLedger`).

`ring_all_reduce` is our own bandwidth-optimal ring over point-to-point sends, an alternative to the
backend's `dist.all_reduce` (`Comm.ring_all_reduce` records it in the ledger).

For scripts, DeepSpeed's module-level functions (`deepspeed.comm.get_rank()` ...) are here too
(`dist_api.py`); they act on the default group, as DeepSpeed's do.
"""

from shardwise.comm.collectives import Comm
from shardwise.comm.dist_api import (  # DeepSpeed's deepspeed.comm functions
    ReduceOp, all_gather, all_gather_coalesced, all_gather_into_tensor, all_gather_object, all_reduce,
    all_reduce_coalesced, all_to_all, all_to_all_single, allgather_fn, barrier, batch_isend_irecv, broadcast,
    broadcast_object_list, destroy_process_group, gather, get_all_ranks_from_group, get_global_rank,
    get_local_rank, get_rank, get_world_group, get_world_size, has_all_gather_into_tensor,
    has_all_reduce_coalesced, has_coalescing_manager, has_reduce_scatter_tensor, inference_all_reduce,
    init_distributed, irecv, is_available, is_initialized, isend, monitored_barrier, new_group, recv, reduce,
    reduce_scatter, reduce_scatter_fn, reduce_scatter_tensor, scatter, send,
)
from shardwise.comm.ledger import CommLedger
from shardwise.comm.ring import ring_all_reduce

__all__ = ["Comm", "CommLedger", "ring_all_reduce", "ReduceOp", "all_gather", "all_gather_coalesced",
           "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_reduce_coalesced", "all_to_all",
           "all_to_all_single", "allgather_fn", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
           "destroy_process_group", "gather", "get_all_ranks_from_group", "get_global_rank", "get_local_rank",
           "get_rank", "get_world_group", "get_world_size", "has_all_gather_into_tensor", "has_all_reduce_coalesced",
           "has_coalescing_manager", "has_reduce_scatter_tensor", "inference_all_reduce", "init_distributed",
           "irecv", "is_available", "is_initialized", "isend", "monitored_barrier", "new_group", "recv", "reduce",
           "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "scatter", "send"]
