"""DeepSpeed's import paths under shardwise (`shardwise.runtime.*`, `shardwise.utils.*`): each module a script or
DeepSpeed's own tests import has the names they import, and the constants and enum members equal DeepSpeed 0.19's
(compared with DeepSpeed where it is installed)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

# module path under deepspeed -> the names scripts and DeepSpeed's tests import from it
PATHS = {
    "runtime.lr_schedules": ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
                             "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR",
                             "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE",
                             "LR_RANGE_TEST_STAIRCASE", "CYCLE_MIN_LR", "CYCLE_MAX_LR", "CYCLE_FIRST_STEP_SIZE",
                             "CYCLE_MIN_MOM", "CYCLE_MAX_MOM", "DECAY_MOM_RATE", "DECAY_LR_RATE", "DECAY_STEP_SIZE",
                             "WARMUP_MIN_LR", "WARMUP_MAX_LR", "WARMUP_NUM_STEPS", "WARMUP_TYPE", "WARMUP_LOG_RATE",
                             "WARMUP_LINEAR_RATE", "WARMUP_MIN_RATIO", "COS_MIN_RATIO", "TOTAL_NUM_STEPS",
                             "VALID_LR_SCHEDULES"],
    "runtime.pipe.topology": ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
                              "PipelineParallelGrid"],
    "runtime.zero": ["GatheredParameters", "Init"],
    "runtime.zero.partition_parameters": ["GatheredParameters", "Init", "ZeroParamStatus"],
    "runtime.zero.config": ["DeepSpeedZeroConfig"],
    "runtime.zero.offload_config": ["OffloadDeviceEnum", "DeepSpeedZeroOffloadOptimizerConfig",
                                    "DeepSpeedZeroOffloadParamConfig"],
    "runtime.activation_checkpointing.checkpointing": ["checkpoint", "configure", "get_cuda_rng_tracker",
                                                       "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint",
                                                       "is_configured", "reset"],
    "runtime.config": ["ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER", "DEEPSPEED_OPTIMIZERS",
                       "TORCH_ADAM_PARAM", "ADAM_W_MODE"],
    "utils": ["RepeatingLoader", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
              "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
              "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
              "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
              "safe_update_full_grad_vectorized"],
    "utils.zero_to_fp32": ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
                           "load_state_dict_from_zero_checkpoint"],
}
CONSTANT_MODULES = ("runtime.lr_schedules", "runtime.config")


def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed")


@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_names_import(path: str) -> None:
    module = importlib.import_module(f"shardwise.{path}")
    missing = [n for n in PATHS[path] if not hasattr(module, n)]
    assert not missing, f"shardwise.{path} lacks {missing}"


@pytest.mark.parametrize("path", CONSTANT_MODULES)
def test_constants_equal_deepspeeds(path: str) -> None:
    _deepspeed()
    ours, theirs = importlib.import_module(f"shardwise.{path}"), importlib.import_module(f"deepspeed.{path}")
    for name in PATHS[path]:
        if name.isupper():
            assert getattr(ours, name) == getattr(theirs, name), name


def test_zero_param_status_members_equal_deepspeeds() -> None:
    _deepspeed()
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as Theirs
    from shardwise.runtime.zero.partition_parameters import ZeroParamStatus as Ours
    assert {m.name: m.value for m in Ours} == {m.name: m.value for m in Theirs}


def test_zero_config_reads_deepspeeds_keys() -> None:
    from shardwise.runtime.zero.config import DeepSpeedZeroConfig
    from shardwise.runtime.zero.offload_config import OffloadDeviceEnum
    config = DeepSpeedZeroConfig(stage=3, offload_optimizer={"device": "cpu"},
                                 stage3_param_persistence_threshold=10)
    assert config.stage == 3 and config.offload_optimizer.device == OffloadDeviceEnum.cpu == "cpu"
    assert config.stage3_param_persistence_threshold == 10
    assert [d.value for d in OffloadDeviceEnum] == ["none", "cpu", "nvme"]


def test_repeating_loader_starts_over() -> None:
    from shardwise.utils import RepeatingLoader
    loader = RepeatingLoader([torch.tensor(1), torch.tensor(2)])
    assert [int(next(loader)) for _ in range(5)] == [1, 2, 1, 2, 1]
    assert iter(loader) is loader
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))


def test_zero_config_answers_deepspeeds_unprefixed_stage3_names() -> None:
    from shardwise.runtime.zero.config import DeepSpeedZeroConfig
    for key in ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                "gather_16bit_weights_on_model_save"):
        assert DeepSpeedZeroConfig(**{key: True}).gather_16bit_weights_on_model_save is True
    config = DeepSpeedZeroConfig(stage3_prefetch_bucket_size=123, stage3_max_live_parameters=7)
    assert (config.prefetch_bucket_size, config.max_live_parameters) == (123, 7)


def test_offload_device_enum_has_deepspeeds_members_and_values() -> None:
    from shardwise.config.zero import ZeroConfig
    from shardwise.runtime.zero.offload_config import OffloadDeviceEnum
    assert [m.name for m in OffloadDeviceEnum] == ["none", "cpu", "nvme"]
    assert OffloadDeviceEnum.cpu == "cpu"
    config = ZeroConfig(stage=3, offload_param={"device": OffloadDeviceEnum.cpu})
    assert config.offload_param is not None and config.offload_param.device == "cpu"


def test_offload_optimizer_config_pipeline_is_either_pipeline_key() -> None:
    from shardwise.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig as Config
    assert Config().pipeline is False
    for read, write in ((True, False), (False, True), (True, True)):
        assert Config(pipeline_read=read, pipeline_write=write).pipeline is True
