"""DeepSpeed's `deepspeed.runtime.zero.offload_config` import path, over shardwise's config sections
(`shardwise.config.zero`): the same fields, defaults and device values ("none", "cpu", "nvme")."""

from shardwise.config.zero import OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig

OffloadDeviceEnum = OffloadDevice
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum"]
