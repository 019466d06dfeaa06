"""The config: DeepSpeed's JSON keys plus shardwise's blocks, validated once at the edge.

    from shardwise.config import load_config
    cfg = load_config("ds_config.json", dp_size=4)      # EngineConfig: frozen sections
    cfg.batch.micro_batch, cfg.precision.dtype, cfg.zero.reduce_bucket_size

Importing this package does not import torch.
"""

from shardwise.config.auto import AutoResolution, AutoValues, resolve_auto
from shardwise.config.batch import BatchSizes, resolve_batch
from shardwise.config.errors import ConfigError, ConfigProblem, ConfigWarning

# DeepSpeed's name for it: scripts that catch `deepspeed.DeepSpeedConfigError` catch ours.
DeepSpeedConfigError = ConfigError
from shardwise.config.load import load_config, load_config_for_world, parse_config, read_config
from shardwise.config.monitoring import MonitoringConfig
from shardwise.config.resolved import CommConfig, DataParallelConfig, DType, EngineConfig, PrecisionConfig
from shardwise.config.schema import (
    ActivationCheckpointingConfig, AllReduceImpl, NonFiniteConfig, OptimizerSpec, PipelineConfig, PipelinePartition,
    PipelineSchedule, RecomputePolicy, SchedulerSpec, TensorParallelConfig,
)
from shardwise.config.zero import OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "ActivationCheckpointingConfig", "AllReduceImpl", "AutoResolution", "AutoValues", "BatchSizes", "CommConfig",
    "ConfigError", "DeepSpeedConfigError", "ConfigProblem", "ConfigWarning", "DataParallelConfig",
    "DType", "EngineConfig", "MonitoringConfig", "NonFiniteConfig", "OffloadDevice", "OffloadOptimizerConfig",
    "OffloadParamConfig", "OptimizerSpec", "PipelineConfig", "PipelinePartition", "PipelineSchedule",
    "PrecisionConfig", "RecomputePolicy", "SchedulerSpec", "TensorParallelConfig", "ZeroConfig", "load_config",
    "load_config_for_world", "parse_config", "read_config", "resolve_auto", "resolve_batch",
]
