"""Communication: every collective goes through a `Comm` (a process group plus its `CommLedger`).

`ring_all_reduce` is our own bandwidth-optimal ring over point-to-point sends, an alternative to the
backend's `dist.all_reduce` (`Comm.ring_all_reduce` records it in the ledger).

For scripts, DeepSpeed's module-level functions (`deepspeed.comm.get_rank()` ...) are here too
(`dist_api.py`); they act on the default group, as DeepSpeed's do.
"""

from shardwise.comm.collectives import Comm
from shardwise.comm.dist_api import (
    ReduceOp, all_gather, all_reduce, barrier, broadcast, get_global_rank, get_local_rank, get_rank, get_world_size,
    init_distributed, is_initialized,
)
from shardwise.comm.ledger import CommLedger
from shardwise.comm.ring import ring_all_reduce

__all__ = ["Comm", "CommLedger", "ring_all_reduce", "ReduceOp", "all_gather", "all_reduce", "barrier", "broadcast",
           "get_global_rank", "get_local_rank", "get_rank", "get_world_size", "init_distributed", "is_initialized"]
