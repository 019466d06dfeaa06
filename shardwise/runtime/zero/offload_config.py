"""DeepSpeed's `deepspeed.runtime.zero.offload_config` import path, over shardwise's config sections
(`shardwise.config.zero`): the same fields, defaults and device values ("none", "cpu", "nvme")."""

import enum

from shardwise.config.zero import OffloadOptimizerConfig, OffloadParamConfig


class OffloadDeviceEnum(str, enum.Enum):
    """DeepSpeed's device names, with its lower-case member names (`OffloadDeviceEnum.cpu`); each is the string a
    config's "device" takes, so `{"device": OffloadDeviceEnum.cpu}` reads as `"cpu"`."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum"]
