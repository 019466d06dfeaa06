"""Read a config (path or dict), validate it once, and resolve it into an `EngineConfig`.

Order: read JSON -> reject "auto" -> schema (pydantic) -> batch rule -> not-yet refusals -> sections.
All problems found at one stage are reported together, one per line.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from pydantic import ValidationError

from shardwise.config.batch import BatchSizes, resolve_batch
from shardwise.config.errors import ConfigError, ConfigProblem, dotted, field_kind, problems_from_validation
from shardwise.config.resolved import (
    ActivationCheckpointingConfig, AllReduceImpl, CommConfig, DType, EngineConfig, OffloadDevice,
    OffloadOptimizerConfig, OffloadParamConfig, OptimizerSpec, PipelineConfig, PipelinePartition,
    PipelineSchedule, PrecisionConfig, RecomputePolicy, SchedulerSpec, TensorParallelConfig, ZeroConfig,
)
from shardwise.config.resolved import (
    CommsLoggerConfig, EventFilesConfig, FlopsProfilerConfig, MonitoringConfig, WandbConfig,
)
from shardwise.config.schema import ConfigModel
from shardwise.config.unsupported import refuse_unimplemented
from shardwise.config.zero import OffloadOptimizerSection, OffloadParamSection, ZeroSection

ConfigSource = str | os.PathLike | dict


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f'duplicate key "{key}" in the config file (JSON would silently keep the last one)',
                              key=key)
        out[key] = value
    return out


def read_config(config: ConfigSource) -> dict[str, Any]:
    """The config as a fresh plain dict: a dict is deep-copied; a path is read as JSON."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"config must be a path to a JSON file or a dict, got {type(config).__name__}")
    path = os.fspath(config)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f'cannot read config file "{path}": {e.strerror or e}') from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ConfigError(f'config file "{path}" is not valid JSON: line {e.lineno} column {e.colno}: '
                          f'{e.msg}') from None
    except ConfigError as e:
        raise ConfigError(f'config file "{path}": {e}', key=e.key) from None
    if not isinstance(data, dict):
        raise ConfigError(f'config file "{path}" must hold a JSON object {{...}}, got {type(data).__name__}')
    return data


def _auto_paths(value: Any, loc: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Where "auto" (the Hugging Face integration's placeholder) appears, as key paths."""
    if isinstance(value, str) and value == "auto":
        return [loc]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _auto_paths(v, loc + (k,))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _auto_paths(v, loc + (i,))]
    return []


def _without(data: Any, loc: tuple[Any, ...]) -> None:
    for part in loc[:-1]:
        data = data[part]
    if isinstance(data, dict):
        del data[loc[-1]]


def parse_config(config: ConfigSource) -> tuple[ConfigModel, dict[str, Any]]:
    """Validate against the schema; returns the model and the raw dict. Raises `ConfigError`."""
    raw = read_config(config)
    autos = _auto_paths(raw)
    problems: list[ConfigProblem] = []
    for loc in autos:
        wanted = {"number": "give a number", "bool": "give true or false"}.get(field_kind(ConfigModel, loc),
                                                                              "give an explicit value")
        problems.append(ConfigProblem(dotted(loc), f'"{dotted(loc)}": "auto" is only meaningful with the Hugging '
                                                   f'Face integration; {wanted}'))
    data = copy.deepcopy(raw)
    for loc in autos:  # validate the rest, so every problem is reported at once
        _without(data, loc)
    try:
        model = ConfigModel.model_validate(data)
    except ValidationError as e:
        problems += problems_from_validation(ConfigModel, e, skip=autos)
    if problems:
        raise ConfigError(problems)
    return model, raw


def _precision(model: ConfigModel) -> PrecisionConfig:
    fp16, bf16 = model.fp16, model.bf16
    dtype = DType.FP16 if fp16.enabled else DType.BF16 if bf16.enabled else DType.FP32
    return PrecisionConfig(
        dtype=dtype, auto_cast=fp16.auto_cast, loss_scale=fp16.loss_scale,
        initial_scale_power=fp16.initial_scale_power, loss_scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_loss_scale=float(fp16.min_loss_scale), bf16_immediate_grad_update=bf16.immediate_grad_update,
        bf16_check_grad_overflow=bf16.check_grad_overflow)


def _offload_optimizer(block: OffloadOptimizerSection | None) -> OffloadOptimizerConfig | None:
    if block is None:
        return None
    fields = block.model_dump()
    return OffloadOptimizerConfig(**{**fields, "device": OffloadDevice(block.device)})


def _offload_param(block: OffloadParamSection | None) -> OffloadParamConfig | None:
    if block is None:
        return None
    fields = block.model_dump()
    return OffloadParamConfig(**{**fields, "device": OffloadDevice(block.device)})


def _zero(block: ZeroSection) -> ZeroConfig:
    fields = block.model_dump(exclude={"offload_optimizer", "offload_param", "zenflow", "leaf_module"})
    # DeepSpeed: overlap_comm unset means "on at stage 3 only".
    overlap = block.overlap_comm if block.overlap_comm is not None else block.stage == 3
    leaf = block.leaf_module
    return ZeroConfig(**{**fields, "overlap_comm": overlap},
                      offload_optimizer=_offload_optimizer(block.offload_optimizer),
                      offload_param=_offload_param(block.offload_param),
                      leaf_module_classes=tuple(leaf.classes), leaf_module_names=tuple(leaf.names),
                      leaf_module_name_suffixes=tuple(leaf.name_suffixes))


def _monitors(model: ConfigModel) -> MonitoringConfig:
    comms = model.comms_logger
    return MonitoringConfig(
        tensorboard=EventFilesConfig(**model.tensorboard.model_dump()),
        csv_monitor=EventFilesConfig(**model.csv_monitor.model_dump()),
        wandb=WandbConfig(**model.wandb.model_dump()),
        comms_logger=CommsLoggerConfig(**{**comms.model_dump(), "prof_ops": tuple(comms.prof_ops)}),
        flops_profiler=FlopsProfilerConfig(**model.flops_profiler.model_dump()),
        steps_per_print=model.steps_per_print, wall_clock_breakdown=model.wall_clock_breakdown)


def _sections(model: ConfigModel, batch: BatchSizes, raw: dict[str, Any]) -> EngineConfig:
    ac, pipe = model.activation_checkpointing, model.pipeline
    return EngineConfig(
        batch=batch,
        precision=_precision(model),
        gradient_clipping=model.gradient_clipping,
        prescale_gradients=model.prescale_gradients,
        gradient_predivide_factor=model.gradient_predivide_factor,
        optimizer=(OptimizerSpec(type=model.optimizer.type, params=copy.deepcopy(model.optimizer.params))
                   if model.optimizer else None),
        scheduler=(SchedulerSpec(type=model.scheduler.type, params=copy.deepcopy(model.scheduler.params))
                   if model.scheduler else None),
        zero=_zero(model.zero_optimization),
        communication=CommConfig(
            all_reduce=AllReduceImpl(model.communication.all_reduce),
            data_type=DType(model.communication_data_type) if model.communication_data_type else None),
        tensor_parallel=TensorParallelConfig(size=model.tensor_parallel.size,
                                             sequence_parallel=model.tensor_parallel.sequence_parallel),
        pipeline=PipelineConfig(stages=pipe.stages, schedule=PipelineSchedule(pipe.schedule),
                                virtual_stages=pipe.virtual_stages, partition=PipelinePartition(pipe.partition)),
        activation_checkpointing=ActivationCheckpointingConfig(
            **{**ac.model_dump(), "policy": RecomputePolicy(ac.policy)}),
        steps_per_print=model.steps_per_print,
        wall_clock_breakdown=model.wall_clock_breakdown,
        memory_breakdown=model.memory_breakdown,
        dataloader_drop_last=model.dataloader_drop_last,
        zero_allow_untested_optimizer=model.zero_allow_untested_optimizer,
        monitors=_monitors(model),
        raw=raw,
    )


def _resolve(model: ConfigModel, raw: dict[str, Any], dp_size: int) -> EngineConfig:
    problems: list[ConfigProblem] = []
    batch = None
    try:
        batch = resolve_batch(train_batch_size=model.train_batch_size,
                              micro_batch=model.train_micro_batch_size_per_gpu,
                              grad_accum=model.gradient_accumulation_steps, dp_size=dp_size)
    except ConfigError as e:
        problems += e.problems
    problems += refuse_unimplemented(model)
    if problems:
        raise ConfigError(problems)
    assert batch is not None
    return _sections(model, batch, raw)


def load_config(config: ConfigSource, *, dp_size: int) -> EngineConfig:
    """Validate a DeepSpeed-style config (JSON path or dict) and resolve it for `dp_size`
    data-parallel ranks. Raises `ConfigError` listing every problem found, one per line."""
    model, raw = parse_config(config)
    return _resolve(model, raw, dp_size)


def load_config_for_world(config: ConfigSource, *, world_size: int) -> EngineConfig:
    """As `load_config`, with the data-parallel size derived from the total number of ranks:
    dp = world_size / (tensor_parallel.size * pipeline.stages), which must divide exactly."""
    model, raw = parse_config(config)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    tp, pp = model.tensor_parallel.size, model.pipeline.stages
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not a multiple of tensor_parallel.size {tp} * pipeline.stages "
                          f"{pp} = {tp * pp}; change the number of processes or the parallel sizes",
                          key="tensor_parallel.size")
    return _resolve(model, raw, world_size // (tp * pp))
