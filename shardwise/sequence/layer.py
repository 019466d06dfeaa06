"""DeepSpeed's `deepspeed.sequence.layer`: `DistributedAttention`, implemented in
`shardwise.parallel.context.distributed_attention`."""

from shardwise.parallel.context.distributed_attention import DistributedAttention

__all__ = ["DistributedAttention"]
