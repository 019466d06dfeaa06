"""The torch-native way in: FSDP2's `fully_shard`, FSDP1's `FullyShardedDataParallel` and `DistributedDataParallel`
over shardwise's own ZeRO-3 units and bucketed all-reduce, for a plain torch optimizer and loop."""

from shardwise.parallel.wrappers.ddp import DistributedDataParallel
from shardwise.parallel.wrappers.fsdp import FullyShardedDataParallel
from shardwise.parallel.wrappers.fully_shard import fully_shard
from shardwise.parallel.wrappers.module import FSDPModule
from shardwise.parallel.wrappers.policies import (
    CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy, OffloadPolicy,
)
from shardwise.parallel.wrappers.state_dict import get_state_dict, set_state_dict

__all__ = ["CPUOffload", "CPUOffloadPolicy", "DistributedDataParallel", "FSDPModule", "FullyShardedDataParallel",
           "MixedPrecision", "MixedPrecisionPolicy", "OffloadPolicy", "fully_shard", "get_state_dict",
           "set_state_dict"]
