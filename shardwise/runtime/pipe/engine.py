"""`deepspeed.runtime.pipe.engine.PipelineEngine`: the engine `initialize` builds for a pipeline model."""

from shardwise.engine.engine import PipelineEngine

__all__ = ["PipelineEngine"]
