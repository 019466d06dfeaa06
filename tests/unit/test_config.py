"""Config schema, error messages and not-yet refusals (shardwise/config/); the batch rule is in test_config_batch.py."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from pathlib import Path

import pytest

from shardwise.config import (
    AllReduceImpl, ConfigError, ConfigWarning, DType, OffloadDevice, load_config, load_config_for_world, parse_config,
    RecomputePolicy,
)
from shardwise.config.deepspeed_blocks import FEATURE_BLOCKS
from shardwise.config.unsupported import FEATURE_NAMES
from shardwise.errors import UserError

from config_cases import BASE, deepspeed, error_of, load  # tests/unit is on sys.path (pytest's rootdir-relative import)


# ----- unknown keys, "auto", types -----

def test_unknown_top_level_key_suggests_the_close_match() -> None:
    err = error_of({**BASE, "zero_optimisation": {"stage": 0}})
    assert err.key == "zero_optimisation"
    assert str(err) == ('unknown key "zero_optimisation": did you mean "zero_optimization"? (DeepSpeed would ignore '
                        'it and lose the setting)')


def test_unknown_nested_key_suggests_and_lists_that_level() -> None:
    err = error_of({**BASE, "zero_optimization": {"overlap_com": True}})
    assert err.key == "zero_optimization.overlap_com"
    text = str(err)
    assert 'unknown key "zero_optimization.overlap_com": did you mean "overlap_comm"?' in text
    assert 'valid keys in "zero_optimization": stage, ' in text
    deeper = error_of({**BASE, "zero_optimization": {"offload_optimizer": {"devise": "cpu"}}})
    assert 'did you mean "device"?' in str(deeper) and "pin_memory" in str(deeper)


def test_a_key_deepspeed_ignores_is_ignored_with_a_warning() -> None:
    with pytest.warns(ConfigWarning, match='unknown key "seed" ignored \\(DeepSpeed ignores unknown top-level'):
        cfg = load({"seed": 1234})
    assert "seed" in cfg.raw


def test_deepspeed_features_we_lack_are_refused_only_when_on() -> None:
    load({"comet": {}, "hybrid_engine": {"enabled": False}})
    err = error_of({**BASE, "comet": {"enabled": True}})
    assert err.key == "comet" and "shardwise does not implement DeepSpeed's Comet monitor" in str(err)
    load({"tensorboard": {"enabled": True, "output_path": "x"}})      # the monitors are implemented
    assert 'did you mean "output_path"' in str(error_of({**BASE, "tensorboard": {"output_pat": "x"}}))


def _switched_on(name: str) -> object:
    # weight_quantization acts (in DeepSpeed's zero.Init) only through quantized_initialization
    return {"compile": {"deepcompile": True}, "datastates_ckpt": {},
            "weight_quantization": {"quantized_initialization": {"num_bits": 8}}}.get(name, {"enabled": True})


@pytest.mark.parametrize("name", FEATURE_BLOCKS)
def test_every_deepspeed_feature_block_is_refused_on_and_accepted_off(name: str) -> None:
    off = {"compile": {"deepcompile": False}, "datastates_ckpt": False}.get(name, {"enabled": False})
    load({name: off})
    err = error_of({**BASE, name: _switched_on(name)})
    assert err.key == name and len(err.problems) == 1 and FEATURE_NAMES[name] in str(err)


def test_unresolvable_autos_name_the_key_and_how_to_give_it() -> None:
    err = error_of({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "fp16": {"enabled": "auto"}})
    lines = str(err).splitlines()
    assert [p.key for p in err.problems] == ["train_micro_batch_size_per_gpu", "optimizer.params.lr"]
    assert lines[0].startswith('"train_micro_batch_size_per_gpu": "auto" needs the micro-batch size')
    assert "auto=AutoValues(micro_batch=...)" in lines[0] and "--micro-batch" in lines[0]
    assert "auto=AutoValues(lr=...)" in lines[1] and "--lr" in lines[1]


def test_every_problem_of_a_config_at_once() -> None:
    err = error_of({"train_batch_size": 30, "zero_optimisation": {}, "comet": {"enabled": True}, "amp": {},
                    "optimizer": {"type": "Adam", "params": {"lr": "auto"}}})
    assert [p.key for p in err.problems] == ["zero_optimisation", "amp", "optimizer.params.lr", "train_batch_size",
                                             "comet"]
    assert len(str(err).splitlines()) == 5
    unfilled_batch = error_of({"train_micro_batch_size_per_gpu": "auto", "comet": {"enabled": True}})
    assert [p.key for p in unfilled_batch.problems] == ["train_micro_batch_size_per_gpu", "comet"]


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
    assert cfg.precision.bf16.check_grad_overflow == precision_config.DeepSpeedBF16Config().check_grad_overflow
    assert cfg.gradient_clipping == constants.GRADIENT_CLIPPING_DEFAULT
    assert cfg.gradient_predivide_factor == constants.GRADIENT_PREDIVIDE_FACTOR_DEFAULT
    assert cfg.steps_per_print == constants.STEPS_PER_PRINT_DEFAULT
    ds_zero = zero_config.DeepSpeedZeroConfig()
    ours = cfg.zero.model_dump()
    for name, info in zero_config.DeepSpeedZeroConfig.model_fields.items():
        if (info.json_schema_extra or {}).get("deprecated") or name in ("zenflow", "leaf_module"):
            continue
        key = info.alias or name
        assert ours[key] == getattr(ds_zero, name), key
    assert list(cfg.zero.leaf_module.classes) == ds_zero.leaf_module.classes


# ----- our blocks, ZeRO spellings -----

def test_our_blocks_resolve_to_enums() -> None:
    cfg = load({"communication": {"all_reduce": "ring"}, "communication_data_type": "BF16",
                "activation_checkpointing": {"policy": "none"}})
    assert cfg.communication.all_reduce is AllReduceImpl.RING and str(cfg.communication.all_reduce) == "ring"
    assert cfg.communication.data_type is DType.BF16
    assert cfg.activation_checkpointing.policy.value == "none"
    every = load({"activation_checkpointing": {"policy": "every_n", "every": 3}}).activation_checkpointing
    assert every.policy is RecomputePolicy.EVERY_N and every.every == 3 and every.blocks is None
    assert load({"activation_checkpointing": {"policy": "selective"}}).activation_checkpointing.policy.value == "selective"
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
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.device"),
])
def test_not_yet_features_are_refused(extra: dict, key: str) -> None:
    err = error_of({**BASE, **extra}, dp_size=1)
    assert err.key == key and len(err.problems) == 1
    assert "not implemented" in str(err) or 'only "cpu" offloading is implemented' in str(err)


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


@pytest.mark.parametrize("block,fix", [
    ({"policy": "every_n"}, 'exactly one of "every"'),
    ({"policy": "every_n", "every": 2, "blocks": 1}, 'exactly one of "every"'),
    ({"policy": "full", "every": 2}, 'set "policy": "every_n"'),
    ({"policy": "every_n", "every": 0}, "activation_checkpointing.every"),
])
def test_every_n_takes_one_knob(block: dict, fix: str) -> None:
    assert fix in str(error_of({**BASE, "activation_checkpointing": block}))


def test_refusals_still_validate_the_keys_and_join_with_batch_errors() -> None:
    assert "did you mean" in str(error_of({**BASE, "tensor_parallel": {"size": 2, "sequence_paralel": True}}))
    nvme = {"stage": 3, "offload_param": {"device": "nvme"}}
    err = error_of({"train_batch_size": 30, "zero_optimization": nvme}, dp_size=4)
    assert [p.key for p in err.problems] == ["train_batch_size", "zero_optimization.offload_param.device"]


def test_nvme_offload_is_refused() -> None:
    err = error_of({**BASE, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}})
    assert 'only "cpu" offloading is implemented' in str(err)


@pytest.mark.parametrize("zero,name", [({"stage": 2, "offload_param": {"device": "nvme"}}, "offload_param"),
                                       ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer")])
def test_offload_below_its_stage_is_ignored_as_deepspeed_ignores_it(zero: dict, name: str) -> None:
    with pytest.warns(ConfigWarning, match=f'"zero_optimization.{name}" has no effect at zero_optimization.stage'):
        cfg = load({"zero_optimization": zero})
    assert not cfg.zero.offloads_params and not cfg.zero.offloads_optimizer


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


def test_comments_trailing_commas_and_base64_are_read_as_deepspeed_reads_them(tmp_path: Path) -> None:
    import base64
    path = tmp_path / "lenient.json"
    path.write_text('{\n  // the global batch\n  "train_batch_size": 16,\n  "fp16": {"enabled": true,},\n}\n')
    expected = load_config({"train_batch_size": 16, "fp16": {"enabled": True}}, dp_size=2)
    assert load_config(path, dp_size=2) == expected
    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 16, "fp16": {"enabled": True}}).encode())
    assert load_config(encoded.decode(), dp_size=2) == expected
    ds_config = deepspeed("deepspeed.runtime.config")
    assert ds_config.DeepSpeedConfig(encoded.decode()).train_batch_size == 16      # DeepSpeed takes it too


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


def test_expert_parallel_block_and_deepspeeds_autoep_spelling() -> None:
    assert load_config_for_world({**BASE, "expert_parallel": {"size": 2}}, world_size=4).expert_parallel.size == 2
    assert load_config_for_world(BASE, world_size=4).expert_parallel.size == 1
    # DeepSpeed's AutoEP block: on only when enabled, its other keys accepted with a warning each
    autoep = {**BASE, "expert_parallel": {"enabled": True, "autoep_size": 4, "preset_model": "mixtral"}}
    with pytest.warns(ConfigWarning, match=r'"expert_parallel.preset_model" tunes DeepSpeed\'s AutoEP'):
        assert load_config_for_world(autoep, world_size=8).expert_parallel.size == 4
    off = {**BASE, "expert_parallel": {"enabled": False, "autoep_size": 4}}
    assert load_config_for_world(off, world_size=2).expert_parallel.size == 1
    both = error_of({**BASE, "expert_parallel": {"size": 2, "autoep_size": 2}})
    assert 'give only one of "expert_parallel.size" and "expert_parallel.autoep_size"' in str(both)
    assert 'did you mean "enabled"' in str(error_of({**BASE, "expert_parallel": {"enabeld": True, "autoep_size": 2}}))
    assert "tensor parallelism inside experts is not implemented" in str(
        error_of({**BASE, "expert_parallel": {"size": 2, "expert_tensor_parallel_size": 2}}))
    # ep splits the data-parallel ranks: dp = world / (tp * pp * cp) must be a multiple of it
    with pytest.raises(ConfigError) as err:
        load_config_for_world({**BASE, "expert_parallel": {"size": 4}, "tensor_parallel": {"size": 2}}, world_size=4)
    assert [p.key for p in err.value.problems] == ["expert_parallel.size"]
    assert str(err.value).count("\n") == 0 and "does not divide the data-parallel size 2" in str(err.value)


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
