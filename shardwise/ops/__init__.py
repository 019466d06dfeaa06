"""DeepSpeed's `deepspeed.ops` names that scripts construct themselves: `shardwise.ops.adam.FusedAdam` and
`DeepSpeedCPUAdam`, both torch's Adam kernels under DeepSpeed's arguments."""

from shardwise.ops import adam

__all__ = ["adam"]
