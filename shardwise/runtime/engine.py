"""`deepspeed.runtime.engine.DeepSpeedEngine`: shardwise's `Engine`, for `isinstance` checks."""

from shardwise.engine.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
