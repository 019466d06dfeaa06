"""DeepSpeed's `deepspeed.runtime.zero.config` import path: `DeepSpeedZeroConfig` is shardwise's
`zero_optimization` section (`shardwise.config.zero.ZeroConfig`), built from the same keyword arguments.

Differences from DeepSpeed's pydantic model: the stage-3 settings are attributes under their config keys
(`stage3_param_persistence_threshold`, `stage3_prefetch_bucket_size`, `stage3_max_live_parameters`, ...), where
DeepSpeed names its attributes without the `stage3_` prefix and accepts the prefixed keys as aliases; deprecated
keys (`cpu_offload` -> `offload_optimizer`, ...) are migrated by both, but DeepSpeed also keeps them as attributes.
"""

from shardwise.config.zero import OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

DeepSpeedZeroConfig = ZeroConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
OffloadDeviceEnum = OffloadDevice

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum"]
