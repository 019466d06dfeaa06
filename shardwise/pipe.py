"""DeepSpeed's `deepspeed.pipe` for scripts (`import shardwise as deepspeed`): `PipelineModule`, `LayerSpec`,
`TiedLayerSpec`, implemented in `shardwise.parallel.pipeline.module`."""

from shardwise.parallel.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
