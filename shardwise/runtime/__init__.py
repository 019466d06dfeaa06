"""DeepSpeed's `deepspeed.runtime` import paths for scripts (`import shardwise as deepspeed`):
`runtime.engine.DeepSpeedEngine`, `runtime.pipe.engine.PipelineEngine`, `runtime.pipe.module.PipelineModule`,
for the `isinstance` checks integrations make. The classes are `shardwise.engine.engine`'s."""
