"""DeepSpeed's `deepspeed.runtime.zero` import path: the same names as `shardwise.zero` (`deepspeed.zero`)."""

from shardwise.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
