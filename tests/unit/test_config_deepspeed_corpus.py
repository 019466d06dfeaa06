"""A corpus of DeepSpeed-style configs, with DeepSpeed 0.19's own parser as the referee.

For every config, shardwise accepts it exactly when `deepspeed.runtime.config.DeepSpeedConfig` does, with three
deliberate exceptions, each marked in the corpus and checked to be one line naming the key:
  UNIMPLEMENTED  a DeepSpeed feature switched on that shardwise does not have: refused;
  MISSPELLED     a top-level key one typo away from a known key: refused with "did you mean" (DeepSpeed
                 silently ignores it, losing the setting);
  AUTO           a Hugging Face "auto" nothing here can fill: refused (Hugging Face refuses it too, or would
                 fill it from a Trainer argument shardwise does not have; where neither fills it, DeepSpeed's
                 parser keeps the string "auto" and its engine fails on it later).
Resolvable "auto" configs are filled first (as Hugging Face fills them before DeepSpeed sees them) and the filled
config goes to DeepSpeed. The world is one process: DeepSpeed's parser then takes a world size of 1 by itself.
"""

from __future__ import annotations

import enum
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from shardwise.config import AutoValues, ConfigError, ConfigWarning, load_config, resolve_auto

from config_cases import deepspeed

H, MICRO, LR = 64, 4, 3e-4
KNOWN = AutoValues(hidden_size=H, micro_batch=MICRO, lr=LR, warmup_num_steps=10, total_num_steps=100)


class Verdict(enum.Enum):
    AGREE = "agree"                  # shardwise accepts iff DeepSpeed does
    UNIMPLEMENTED = "unimplemented"
    MISSPELLED = "misspelled"
    AUTO = "auto"


@dataclass(frozen=True)
class Case:
    name: str
    config: dict[str, Any] | str      # a str is the text of a config file
    verdict: Verdict = Verdict.AGREE
    key: str | None = None            # the key named by shardwise's one-line refusal
    warnings: int = 0                 # ConfigWarning lines shardwise emits when it accepts
    known: AutoValues = field(default_factory=AutoValues)


def with_batch(**config: Any) -> dict[str, Any]:
    return {"train_batch_size": 8, **config}


HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": "auto",
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
HF_ZERO3 = {
    **HF_ZERO2,
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
}

CORPUS = [
    # Hugging Face's own example configs, "auto" filled.
    Case("hf_zero2_autos", HF_ZERO2, known=KNOWN),
    Case("hf_zero3_autos", HF_ZERO3, known=KNOWN),
    Case("auto_in_a_deepspeed_block_is_dropped", with_batch(zero_optimization={"stage": 1, "sub_group_size": "auto"}),
         warnings=1),
    Case("auto_deep_in_a_deepspeed_block", with_batch(
        zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": "auto"}},
        tensor_parallel={"autotp_size": "auto"}), warnings=2),
    # DeepSpeed's parser keeps a top-level "auto" as the string; its engine would then fail on it.
    Case("auto_without_a_hugging_face_meaning", with_batch(steps_per_print="auto"), Verdict.AUTO, "steps_per_print"),
    Case("zero3_keys_auto_below_stage_3", with_batch(zero_optimization={
        "stage": 2, "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"})),
    Case("auto_bucket_without_hidden_size", with_batch(zero_optimization={"stage": 2, "reduce_bucket_size": "auto"}),
         Verdict.AUTO, "zero_optimization.reduce_bucket_size"),
    Case("auto_lr_without_lr", with_batch(optimizer={"type": "AdamW", "params": {"lr": "auto"}}),
         Verdict.AUTO, "optimizer.params.lr", known=AutoValues(hidden_size=H)),
    Case("auto_micro_batch_without_micro_batch", {"train_micro_batch_size_per_gpu": "auto",
                                                  "gradient_accumulation_steps": 2},
         Verdict.AUTO, "train_micro_batch_size_per_gpu"),
    # Top-level keys DeepSpeed never reads: accepted, one warning each.
    Case("ignored_top_level_keys", with_batch(comms_config={"x": 1}, monitor_config={"enabled": True}, fp8={},
                                              cuda_visible_devices="0,1", seed=1234), warnings=5),
    # Blocks present but switched off, whatever their settings.
    Case("disabled_monitors", with_batch(tensorboard={"enabled": False, "output_path": "/tmp/tb"},
                                         wandb={"enabled": False, "project": "p"},
                                         csv_monitor={"enabled": False, "job_name": "j"},
                                         comet={"enabled": False, "samples_log_interval": 10})),
    Case("disabled_hybrid_engine", with_batch(hybrid_engine={"enabled": False, "max_out_tokens": 1024,
                                                             "inference_tp_size": 2})),
    Case("disabled_flops_profiler", with_batch(flops_profiler={"enabled": False, "profile_step": 3, "detailed": True})),
    Case("weight_quantization_off", with_batch(weight_quantization={"enabled": False, "num_bits": 4})),
    # Empty dicts are DeepSpeed's defaults: nothing to quantize. post_init_quant serves only its inference call.
    Case("weight_quantization_empty", with_batch(weight_quantization={"post_init_quant": {},
                                                                      "quantized_initialization": {}})),
    Case("weight_quantization_post_init_only", with_batch(weight_quantization={"post_init_quant": {"fc": {}}}),
         warnings=1),
    Case("weight_quantization_bad_q_type", with_batch(weight_quantization={"q_type": "Symmetric"}),
         key="weight_quantization.q_type"),
    # Blocks DeepSpeed validates with lax pydantic models take numbers and booleans as strings, true as 1, 1 as
    # true; top-level keys it reads with dict.get do not (its batch arithmetic then fails).
    Case("lax_values_in_deepspeed_blocks", with_batch(
        zero_optimization={"stage": "2", "overlap_comm": "true", "reduce_bucket_size": "500",
                           "offload_optimizer": {"device": "cpu", "pin_memory": "false"}},
        fp16={"enabled": "true", "loss_scale": "0", "initial_scale_power": "16"},
        tensorboard={"enabled": "false", "output_path": "/tmp/tb"}, comms_logger={"enabled": 0},
        tensor_parallel={"autotp_size": "0"}, hybrid_engine={"enabled": False, "max_out_tokens": "8"})),
    Case("lax_stage_true_is_1", with_batch(zero_optimization={"stage": True}, bf16={"enabled": 1})),
    Case("lax_stage_from_float_string", with_batch(zero_optimization={"stage": "3.0", "cpu_offload": "false"})),
    Case("lax_float_string_is_no_integer", with_batch(zero_optimization={"stage": 2, "reduce_bucket_size": "5e8"}),
         key="zero_optimization.reduce_bucket_size"),
    Case("lax_stage_not_a_stage", with_batch(zero_optimization={"stage": 1.5}), key="zero_optimization.stage"),
    Case("top_level_number_as_string", {"train_batch_size": "8"}, key="train_batch_size"),
    Case("misspelled_key_in_a_disabled_block", with_batch(tensorboard={"enabled": False, "output_pat": "/tmp"}),
         key="tensorboard.output_pat"),
    # Settings with nothing to act on here.
    Case("aio_without_nvme", with_batch(aio={"block_size": 1048576, "queue_depth": 8, "single_submit": False}),
         warnings=1),
    Case("offload_param_below_stage_3", with_batch(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}),
         warnings=1),
    Case("seq_parallel_communication_data_type", with_batch(seq_parallel_communication_data_type="bf16"), warnings=1),
    Case("checkpoint_options", with_batch(checkpoint={"tag_validation": "fail", "use_node_local_storage": True}),
         warnings=1),
    Case("checkpoint_tag_validation_only", with_batch(checkpoint={"tag_validation": "Fail"})),   # enforced: silent
    Case("checkpoint_storage_options", with_batch(checkpoint={"tag_validation": "Ignore", "load_universal": True,
                                                              "parallel_write": {"pipeline_stage": True}}),
         warnings=2),
    Case("checkpoint_bad_tag_validation", with_batch(checkpoint={"tag_validation": "Sometimes"}),
         key="checkpoint.tag_validation"),
    Case("data_types_default", with_batch(data_types={"keep_in_fp32_modules": "auto"})),
    Case("deepspeed_pipeline_keys", with_batch(pipeline={"seed_layers": False, "activation_checkpoint_interval": 0,
                                                         "pipe_partitioned": True, "grad_partitioned": True}),
         warnings=3),
    Case("deepspeed_autotp_keys", with_batch(tensor_parallel={"autotp_size": 1, "tp_overlap_comm": False,
                                                              "preset_model": "llama"}), warnings=2),
    # Lenient files (DeepSpeed reads them with hjson).
    Case("trailing_commas", '{"train_batch_size": 8, "fp16": {"enabled": true,},}'),
    Case("comments", '// a comment\n{\n  # another\n  "train_batch_size": 8, /* and another */\n'
                     '  "bf16": {"enabled": true}\n}'),
    Case("unquoted_keys", "{train_batch_size: 8, zero_optimization: {stage: 1}}"),
    Case("duplicate_keys", '{"train_batch_size": 8, "train_batch_size": 16}', key="train_batch_size"),
    # Errors DeepSpeed makes too.
    Case("misspelled_nested_key", with_batch(zero_optimization={"stage": 2, "overlap_com": True}),
         key="zero_optimization.overlap_com"),
    Case("removed_feature_amp", with_batch(amp={"enabled": True}), key="amp"),
    Case("fp16_and_bf16", with_batch(fp16={"enabled": True}, bf16={"enabled": True}), key="fp16.enabled"),
    Case("bad_allreduce_op", with_batch(gradient_allreduce_op="max"), key="gradient_allreduce_op"),
    Case("bad_zero_stage", with_batch(zero_optimization={"stage": 4}), key="zero_optimization.stage"),
    # Top-level misspellings: DeepSpeed would drop the setting silently.
    Case("misspelled_top_level_key", with_batch(zero_optimisation={"stage": 2}), Verdict.MISSPELLED,
         "zero_optimisation"),
    Case("misspelled_micro_batch", {"train_micro_batch_size": 4, "train_batch_size": 8}, Verdict.MISSPELLED,
         "train_micro_batch_size"),
    Case("misspelled_enabled_in_a_lenient_block", with_batch(flops_profiler={"enabeld": True}), Verdict.MISSPELLED,
         "flops_profiler.enabeld"),
    # Switched-on features shardwise does not have.
    Case("tensorboard_on", with_batch(tensorboard={"enabled": True, "output_path": "/tmp/tb"}), Verdict.AGREE),
    Case("comms_logger_on", with_batch(comms_logger={"enabled": True, "verbose": False}), Verdict.AGREE),
    Case("flops_profiler_on", with_batch(flops_profiler={"enabled": True}), Verdict.AGREE),
    Case("comet_on", with_batch(comet={"enabled": True}), Verdict.UNIMPLEMENTED, "comet"),
    Case("deepcompile_on", with_batch(compile={"deepcompile": True}), Verdict.UNIMPLEMENTED, "compile"),
    Case("nvme_offload", with_batch(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                                         "nvme_path": "/nvme"}}),
         Verdict.UNIMPLEMENTED, "zero_optimization.offload_optimizer.device"),
    Case("zero_plus_plus", with_batch(zero_optimization={"stage": 3, "zero_quantized_gradients": True}),
         Verdict.UNIMPLEMENTED, "zero_optimization.zero_quantized_gradients"),
    Case("zero_plus_plus_below_stage_3", with_batch(zero_optimization={"stage": 2, "zero_quantized_weights": True})),
    Case("zero_plus_plus_hpz", with_batch(zero_optimization={"stage": 3, "zero_hpz_partition_size": 8}),
         Verdict.UNIMPLEMENTED, "zero_optimization.zero_hpz_partition_size"),
    Case("partial_offload", with_batch(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                                            "ratio": 0.3}}),
         Verdict.UNIMPLEMENTED, "zero_optimization.offload_optimizer.ratio"),
    Case("allreduce_sum", with_batch(gradient_allreduce_op="sum"), Verdict.UNIMPLEMENTED, "gradient_allreduce_op"),
    Case("grad_accum_dtype", with_batch(data_types={"grad_accum_dtype": "fp32"}), Verdict.UNIMPLEMENTED,
         "data_types.grad_accum_dtype"),
    Case("weight_quantization_at_init", with_batch(weight_quantization={"quantized_initialization": {"num_bits": 8}}),
         Verdict.UNIMPLEMENTED, "weight_quantization"),
    Case("pipeline_layer_checkpointing", with_batch(pipeline={"activation_checkpoint_interval": 1}),
         Verdict.UNIMPLEMENTED, "pipeline.activation_checkpoint_interval"),
    Case("ulysses", with_batch(sequence_parallel_size=2)),
]


def source(case: Case, tmp_path: Path) -> dict[str, Any] | str:
    if isinstance(case.config, str):
        path = tmp_path / f"{case.name}.json"
        path.write_text(case.config)
        return str(path)
    return case.config


def deepspeed_accepts(config: dict[str, Any] | str) -> bool:
    ds_config = deepspeed("deepspeed.runtime.config")
    try:
        ds_config.DeepSpeedConfig(config)
    except Exception:       # DeepSpeed raises whatever its parsers raise: asserts, ValueError, pydantic's errors
        return False
    return True


def shardwise_verdict(case: Case, config: dict[str, Any] | str) -> tuple[ConfigError | None, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            load_config(config, dp_size=1, auto=case.known)
        except ConfigError as e:
            return e, []
    return None, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_the_corpus_covers_every_rule() -> None:
    assert len(CORPUS) >= 20 and len({c.name for c in CORPUS}) == len(CORPUS)
    assert {c.verdict for c in CORPUS} == set(Verdict)


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.name)
def test_deepspeed_is_the_referee(case: Case, tmp_path: Path) -> None:
    config = source(case, tmp_path)
    error, warned = shardwise_verdict(case, config)
    if case.verdict is Verdict.AUTO:
        assert error is not None and [p.key for p in error.problems] == [case.key], error
        assert '"auto"' in str(error) and ("AutoValues(" in str(error) or "write the value" in str(error))
        return
    if isinstance(config, dict) and case.known != AutoValues():
        config = resolve_auto(config, case.known).config    # Hugging Face fills these before DeepSpeed sees them
    accepted_by_deepspeed = deepspeed_accepts(config)
    if case.verdict is Verdict.AGREE:
        assert (error is None) == accepted_by_deepspeed, (case.name, str(error))
        if error is not None and case.key is not None:
            assert error.key == case.key and len(error.problems) == 1, str(error)
        if error is None:
            assert len(warned) == case.warnings, warned
            assert all("\n" not in line for line in warned)
        return
    assert accepted_by_deepspeed, f"{case.name}: DeepSpeed refuses it; the case belongs to AGREE"
    assert error is not None and len(error.problems) == 1 and len(str(error).splitlines()) == 1, str(error)
    assert error.key == case.key, str(error)
    if case.verdict is Verdict.MISSPELLED:
        assert "did you mean" in str(error)
    else:
        assert "implement" in str(error)       # "not implemented", "only ... is implemented", "does not implement"


def test_filled_values_follow_hugging_face() -> None:
    """The values Hugging Face's integration writes for its ZeRO-3 example, given the same inputs."""
    cfg = load_config(HF_ZERO3, dp_size=2, auto=KNOWN)
    assert (cfg.batch.micro_batch, cfg.batch.grad_accum, cfg.batch.train_batch_size) == (MICRO, 1, 2 * MICRO)
    assert cfg.zero.reduce_bucket_size == H * H
    assert cfg.zero.stage3_prefetch_bucket_size == int(0.9 * H * H)
    assert cfg.zero.stage3_param_persistence_threshold == 10 * H
    assert cfg.gradient_clipping == 1.0 and cfg.precision.dtype.value == "fp32"
    assert cfg.optimizer.params == {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert cfg.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": 10,
                                    "total_num_steps": 100}
    bf16 = load_config(HF_ZERO2, dp_size=1, auto=AutoValues(hidden_size=H, micro_batch=2, lr=LR,
                                                            warmup_num_steps=5, precision="bf16"))
    assert bf16.precision.dtype.value == "bf16" and bf16.zero.reduce_bucket_size == H * H


def test_lax_values_resolve_as_deepspeed_reads_them() -> None:
    """The values, not only the verdict: shardwise reads the strings of DeepSpeed's lax blocks as DeepSpeed does."""
    case = next(c for c in CORPUS if c.name == "lax_values_in_deepspeed_blocks")
    ours = load_config(case.config, dp_size=1)
    theirs = deepspeed("deepspeed.runtime.config").DeepSpeedConfig(case.config)
    zero = theirs.zero_config
    assert (ours.zero.stage, ours.zero.overlap_comm, ours.zero.reduce_bucket_size) == \
        (int(zero.stage), zero.overlap_comm, zero.reduce_bucket_size) == (2, True, 500)
    assert ours.zero.offload_optimizer.pin_memory is zero.offload_optimizer.pin_memory is False
    fp16 = theirs.float16_config
    assert (ours.precision.dtype.value, ours.precision.loss_scale, ours.precision.initial_scale_power) == \
        ("fp16", fp16.loss_scale, fp16.initial_scale_power) == ("fp16", 0.0, 16)
    assert ours.tensor_parallel.size == 1 and not ours.monitors.tensorboard.enabled
    stage3 = load_config(with_batch(zero_optimization={"stage": "3"}), dp_size=1)
    assert stage3.zero.stage == 3 and stage3.zero.overlap_comm      # stage 3's default, from the string
    assert load_config(with_batch(zero_optimization={"stage": True}), dp_size=1).zero.stage == 1
    # "auto" stage-3 keys follow a stage written as a string
    filled = resolve_auto({**HF_ZERO3, "zero_optimization": {**HF_ZERO3["zero_optimization"], "stage": "3"}}, KNOWN)
    assert filled.config["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * H


def test_resolve_auto_is_pure_and_reports_every_key_at_once() -> None:
    raw = json.loads(json.dumps(HF_ZERO3))
    out = resolve_auto(raw)
    assert raw == HF_ZERO3                    # the input is left alone
    assert [p.key for p in out.problems] == [
        "optimizer.params.lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps", "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
        "train_micro_batch_size_per_gpu"]        # train_batch_size follows from it, so it is not a problem of its own
    assert all(out.config is not raw and p.message.count("\n") == 0 for p in out.problems)
    assert '"zero_optimization.reduce_bucket_size": "auto" needs the model\'s hidden size' in out.problems[4].message


def test_checkpoint_warnings_name_each_key_without_effect() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(with_batch(checkpoint={"tag_validation": "Fail", "use_node_local_storage": True,
                                           "tag_validaton": "Fail"}), dp_size=1)
    lines = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(lines) == 2 and not any("tag_validation" in line for line in lines), lines
    assert lines[0].startswith('"checkpoint.tag_validaton" is not a key DeepSpeed reads')
    assert lines[1].startswith('"checkpoint.use_node_local_storage" has no effect in shardwise')
