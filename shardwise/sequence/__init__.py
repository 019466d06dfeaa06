"""DeepSpeed's `deepspeed.sequence` for scripts (`import shardwise as deepspeed`): `layer.DistributedAttention`."""

from shardwise.sequence import layer

__all__ = ["layer"]
