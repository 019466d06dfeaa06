"""`deepspeed.runtime.pipe`: `PipelineModule`, `LayerSpec`, `TiedLayerSpec` (as `shardwise.pipe`)."""

from shardwise.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
