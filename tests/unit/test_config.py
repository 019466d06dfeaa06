"""Config schema, error messages and not-yet refusals (shardwise/config/); the batch rule is in test_config_batch.py."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from pathlib import Path

import pytest

from shardwise.config import (
    AllReduceImpl, ConfigError, DType, OffloadDevice, load_config, load_config_for_world, parse_config,
)
from shardwise.errors import UserError

from config_cases import BASE, deepspeed, error_of, load  # tests/unit is on sys.path (pytest's rootdir-relative import)


# ----- unknown keys, "auto", types -----

def test_unknown_top_level_key_suggests_the_close_match() -> None:
    err = error_of({**BASE, "zero_optimisation": {"stage": 0}})
    assert err.key == "zero_optimisation"
    assert str(err).startswith('unknown key "zero_optimisation": did you mean "zero_optimization"? valid keys: ')
    assert "train_micro_batch_size_per_gpu" in str(err)


def test_unknown_nested_key_suggests_and_lists_that_level() -> None:
    err = error_of({**BASE, "zero_optimization": {"overlap_com": True}})
    assert err.key == "zero_optimization.overlap_com"
    text = str(err)
    assert 'unknown key "zero_optimization.overlap_com": did you mean "overlap_comm"?' in text
    assert 'valid keys in "zero_optimization": stage, ' in text
    deeper = error_of({**BASE, "zero_optimization": {"offload_optimizer": {"devise": "cpu"}}})
    assert 'did you mean "device"?' in str(deeper) and "pin_memory" in str(deeper)


def test_seed_is_not_a_deepspeed_key() -> None:
    err = error_of({**BASE, "seed": 1234})
    assert err.key == "seed" and str(err).startswith('unknown key "seed":')


def test_deepspeed_features_we_lack_say_so() -> None:
    assert "DeepSpeed feature that shardwise does not implement" in str(error_of({**BASE, "comet": {}}))


def test_auto_is_refused_with_the_hugging_face_hint() -> None:
    err = error_of({"train_batch_size": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                    "fp16": {"enabled": "auto"}})
    lines = str(err).splitlines()
    assert lines[0] == ('"train_batch_size": "auto" is only meaningful with the Hugging Face integration; '
                        'give a number')
    assert '"optimizer.params.lr": "auto"' in lines[1]
    assert lines[2].endswith("give true or false")
    assert len(lines) == 3 and err.key == "train_batch_size"


def test_integral_floats_are_integers() -> None:
    cfg = load({"zero_optimization": {"reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8}})
    assert cfg.zero.reduce_bucket_size == 500_000_000 and isinstance(cfg.zero.reduce_bucket_size, int)
    assert load_config({"train_batch_size": 32.0}, dp_size=4).batch.train_batch_size == 32


@pytest.mark.parametrize("value,reason", [(32.5, "fractional part"), (True, "boolean"), ("32", "expected an integer")])
def test_non_integers_are_rejected(value: object, reason: str) -> None:
    err = error_of({"train_batch_size": value})
    assert err.key == "train_batch_size" and reason in str(err) and json.dumps(value) in str(err)


def test_bounds_and_choices_name_the_rule() -> None:
    assert '"zero_optimization.reduce_bucket_size": 0 must be > 0' in str(
        error_of({**BASE, "zero_optimization": {"reduce_bucket_size": 0}}))
    text = str(error_of({**BASE, "communication": {"all_reduce": "tree"}}))
    assert '"communication.all_reduce": "tree" is not allowed' in text and "'ring'" in text
    assert "ZeRO stage must be 0, 1, 2 or 3" in str(error_of({**BASE, "zero_optimization": {"stage": 4}}))


def test_several_problems_are_reported_together() -> None:
    err = error_of({**BASE, "steps_per_print": 0, "fp16": {"enabeld": True}, "gradient_clipping": -1})
    assert len(err.problems) == 3 and len(str(err).splitlines()) == 3
    assert {p.key for p in err.problems} == {"steps_per_print", "fp16.enabeld", "gradient_clipping"}


# ----- precision -----

def test_fp16_and_bf16_together_is_deepspeeds_error() -> None:
    err = error_of({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "bfloat16 and fp16 modes cannot be simultaneously enabled" in str(err)
    assert err.key == "fp16.enabled"


def test_bfloat16_is_an_alias_of_bf16() -> None:
    assert load({"bfloat16": {"enabled": True}}).precision.dtype is DType.BF16
    assert "give only one of" in str(error_of({**BASE, "bf16": {}, "bfloat16": {}}))


def test_precision_section() -> None:
    fp32 = load({})
    assert fp32.precision.dtype is DType.FP32 and not fp32.precision.dynamic_loss_scale
    assert fp32.precision.static_loss_scale == 1.0
    dynamic = load({"fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 3}}).precision
    assert dynamic.dtype is DType.FP16 and dynamic.dynamic_loss_scale
    assert dynamic.initial_loss_scale == 4096.0 and dynamic.hysteresis == 3
    static = load({"fp16": {"enabled": True, "loss_scale": 128}}).precision
    assert not static.dynamic_loss_scale and static.static_loss_scale == 128.0


def test_dynamic_loss_scale_rules_apply_only_when_dynamic() -> None:
    assert "fp16.loss_scale_window" in str(error_of({**BASE, "fp16": {"enabled": True, "loss_scale_window": 0}}))
    load({"fp16": {"enabled": True, "loss_scale": 8, "loss_scale_window": 0}})  # static: unused, accepted


def test_defaults_match_deepspeed() -> None:
    precision_config = deepspeed("deepspeed.runtime.precision_config")
    zero_config = deepspeed("deepspeed.runtime.zero.config")
    constants = deepspeed("deepspeed.runtime.constants")
    cfg = load({})
    fp16 = precision_config.DeepSpeedFP16Config()
    for name in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                 "min_loss_scale", "auto_cast"):
        assert getattr(cfg.precision, name) == getattr(fp16, name), name
    assert cfg.precision.bf16_check_grad_overflow == precision_config.DeepSpeedBF16Config().check_grad_overflow
    assert cfg.gradient_clipping == constants.GRADIENT_CLIPPING_DEFAULT
    assert cfg.gradient_predivide_factor == constants.GRADIENT_PREDIVIDE_FACTOR_DEFAULT
    assert cfg.steps_per_print == constants.STEPS_PER_PRINT_DEFAULT
    ds_zero = zero_config.DeepSpeedZeroConfig()
    ours = dataclasses.asdict(cfg.zero)
    for name, info in zero_config.DeepSpeedZeroConfig.model_fields.items():
        if (info.json_schema_extra or {}).get("deprecated") or name in ("zenflow", "leaf_module"):
            continue
        key = info.alias or name
        assert ours[key] == getattr(ds_zero, name), key
    assert list(cfg.zero.leaf_module_classes) == ds_zero.leaf_module.classes


# ----- our blocks, ZeRO spellings -----

def test_our_blocks_resolve_to_enums() -> None:
    cfg = load({"communication": {"all_reduce": "ring"}, "communication_data_type": "BF16",
                "activation_checkpointing": {"policy": "none"}})
    assert cfg.communication.all_reduce is AllReduceImpl.RING and str(cfg.communication.all_reduce) == "ring"
    assert cfg.communication.data_type is DType.BF16
    assert cfg.activation_checkpointing.policy.value == "none"
    model, _ = parse_config({"activation_checkpointing": {"policy": "selective"}})   # schema-valid ...
    assert model.activation_checkpointing.policy == "selective"
    assert "not implemented yet" in str(error_of({**BASE, "activation_checkpointing": {"policy": "full"}}))  # ... refused
    assert cfg.pipeline.schedule.value == "1f1b" and cfg.tensor_parallel.size == 1


def test_pipeline_and_tensor_parallel_rules() -> None:
    assert "needs \"pipeline.schedule\": \"interleaved_1f1b\"" in str(
        error_of({**BASE, "pipeline": {"virtual_stages": 2}}))
    sequence_parallel_alone = {**BASE, "tensor_parallel": {"sequence_parallel": True}}
    assert 'needs "tensor_parallel.size" > 1' in str(error_of(sequence_parallel_alone))
    assert load({"tensor_parallel": {"autotp_size": 0}}).tensor_parallel.size == 1  # DeepSpeed: 0 = off
    piped = load_config_for_world({**BASE, "gradient_accumulation_steps": 4,
                                   "pipeline": {"stages": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2,
                                                "partition": "parameters"}}, world_size=8)
    assert piped.pipeline.stages == 2 and piped.pipeline.virtual_stages == 2 and piped.batch.dp_size == 4
    assert piped.pipeline.schedule.value == "interleaved_1f1b" and piped.pipeline.partition.value == "parameters"
    three_d = load_config_for_world({**BASE, "pipeline": {"stages": 2}, "tensor_parallel": {"size": 2}}, world_size=8)
    assert three_d.batch.dp_size == 2 and three_d.batch.micro_batch == 16      # dp = 8 / (pp 2 x tp 2)


def test_zero_alternative_and_deprecated_spellings() -> None:
    cfg = load({"zero_optimization": {"prefetch_bucket_size": 1e6, "stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.zero.stage3_prefetch_bucket_size == 1_000_000
    assert cfg.zero.stage3_gather_16bit_weights_on_model_save
    assert "give only one of" in str(error_of(
        {**BASE, "zero_optimization": {"max_live_parameters": 1, "stage3_max_live_parameters": 2}}))
    model, _ = parse_config({"zero_optimization": {"stage": 1, "cpu_offload": True}})
    assert model.zero_optimization.offload_optimizer.device == "cpu"


def test_overlap_comm_default_follows_the_stage() -> None:
    assert load({}).zero.overlap_comm is False
    assert load({"zero_optimization": {"overlap_comm": True}}).zero.overlap_comm is True


# ----- not-yet refusals -----

def test_zero_stage_3_is_accepted() -> None:
    cfg = load({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}})
    assert cfg.zero.stage == 3 and cfg.zero.stage3_param_persistence_threshold == 10
    piped = load({"pipeline": {"stages": 2}, "zero_optimization": {"stage": 3}}, dp_size=2)   # DeepSpeed refuses it
    assert piped.pipeline.stages == 2 and piped.zero.stage == 3


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tensor_parallel_composes_with_every_zero_stage(stage: int) -> None:
    cfg = load_config_for_world({**BASE, "tensor_parallel": {"size": 2}, "zero_optimization": {"stage": stage}},
                                world_size=4)
    assert cfg.tensor_parallel.size == 2 and cfg.zero.stage == stage and cfg.batch.dp_size == 2


@pytest.mark.parametrize("extra,key", [
    ({"activation_checkpointing": {"policy": "full"}}, "activation_checkpointing.policy"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "zero_optimization.offload_optimizer.device"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, "zero_optimization.offload_param.device"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}}, "activation_checkpointing.cpu_checkpointing"),
])
def test_not_yet_features_are_refused(extra: dict, key: str) -> None:
    err = error_of({**BASE, **extra}, dp_size=1)
    assert err.key == key and len(err.problems) == 1
    assert "not implemented" in str(err) or "needs zero_optimization.stage >=" in str(err)


@pytest.mark.parametrize("extra,key", [
    ({"communication": {"all_reduce": "ring"}}, "communication.all_reduce"),
    ({"communication_data_type": "bf16"}, "communication_data_type"),
    ({"prescale_gradients": True}, "prescale_gradients"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
])
@pytest.mark.parametrize("stage", [1, 3])
def test_stage0_reduction_options_are_refused_under_zero(extra: dict, key: str, stage: int) -> None:
    err = error_of({**BASE, **extra, "zero_optimization": {"stage": stage}}, dp_size=1)
    assert err.key == key and len(err.problems) == 1
    assert "only supported with zero_optimization.stage 0" in str(err) and "remove it" in str(err)
    load({**BASE, **extra}, dp_size=1)       # stage 0 runs them


def test_refusals_still_validate_the_keys_and_join_with_batch_errors() -> None:
    assert "did you mean" in str(error_of({**BASE, "tensor_parallel": {"size": 2, "sequence_paralel": True}}))
    nvme = {"stage": 3, "offload_param": {"device": "nvme"}}
    err = error_of({"train_batch_size": 30, "zero_optimization": nvme}, dp_size=4)
    assert [p.key for p in err.problems] == ["train_batch_size", "zero_optimization.offload_param.device"]


@pytest.mark.parametrize("zero,message", [
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "parameter offloading needs zero_optimization.stage >= 3"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "optimizer offloading needs zero_optimization.stage >= 1"),
    ({"stage": 1, "offload_optimizer": {"device": "nvme"}}, 'only "cpu" offloading is implemented'),
])
def test_invalid_offload_combinations(zero: dict, message: str) -> None:
    assert message in str(error_of({**BASE, "zero_optimization": zero}))


def test_optimizer_offload_with_stages_1_to_3() -> None:
    assert load({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}).zero.offloads_params
    for stage in (1, 2, 3):
        assert load({"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}).zero.offloads_optimizer


def test_offload_device_none_is_fine() -> None:
    cfg = load({"zero_optimization": {"offload_optimizer": {"device": "none", "pin_memory": False}}})
    assert cfg.zero.offload_optimizer.device is OffloadDevice.NONE and not cfg.zero.offloads_optimizer


# ----- files, world size, the EngineConfig object -----

def test_missing_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f'cannot read config file "{tmp_path}/nope.json"'):
        load_config(tmp_path / "nope.json", dp_size=1)


def test_bad_json_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16" {}\n}\n')
    with pytest.raises(ConfigError, match=r'config file ".*bad.json" is not valid JSON: line 3 column 10'):
        load_config(str(path), dp_size=1)


def test_duplicate_keys_and_non_objects_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match='duplicate key "train_batch_size"'):
        load_config(path, dp_size=1)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        load_config(path, dp_size=1)


def test_path_and_dict_give_the_same_config(tmp_path: Path) -> None:
    config = {"train_batch_size": 16, "fp16": {"enabled": True}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert load_config(os.fspath(path), dp_size=2) == load_config(config, dp_size=2)


def test_world_size_gives_the_data_parallel_size() -> None:
    assert load_config_for_world(BASE, world_size=8).batch.dp_size == 8
    tensor_parallel = load_config_for_world({**BASE, "tensor_parallel": {"size": 2, "sequence_parallel": True}},
                                            world_size=8)
    assert tensor_parallel.batch.dp_size == 4 and tensor_parallel.batch.micro_batch == 8
    assert tensor_parallel.tensor_parallel.size == 2 and tensor_parallel.tensor_parallel.sequence_parallel
    assert load_config_for_world({**BASE, "tensor_parallel": {"autotp_size": 4}}, world_size=4).batch.dp_size == 1
    with pytest.raises(ConfigError, match=r"world size 3 is not a multiple of tensor_parallel.size 2 \* "
                                          r"pipeline.stages 1 = 2"):
        load_config_for_world({**BASE, "tensor_parallel": {"size": 2}}, world_size=3)


def test_engine_config_is_frozen_and_keeps_a_raw_copy() -> None:
    given = {"train_batch_size": 32, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    cfg = load_config(given, dp_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gradient_clipping = 0.0  # type: ignore[misc]
    given["optimizer"]["params"]["lr"] = 5.0
    assert cfg.raw["optimizer"]["params"]["lr"] == 0.1 and cfg.optimizer.params["lr"] == 0.1
    described = cfg.describe()
    assert json.loads(json.dumps(described)) == described
    assert described["batch"]["arithmetic"].startswith("train_batch_size 32 = ")
    assert "raw" not in described


def test_config_error_is_a_user_error_and_pickles() -> None:
    err = error_of({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert isinstance(err, UserError) and isinstance(err, ValueError)
    again = pickle.loads(pickle.dumps(err))
    assert again.key == err.key and str(again) == str(err)
