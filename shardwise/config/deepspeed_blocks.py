"""DeepSpeed's top-level keys that shardwise reads but does not act on, validated as DeepSpeed validates them.

Blocks DeepSpeed 0.19 parses with models that forbid unknown keys ("comet", "hybrid_engine", "compile", ...)
forbid them here too; blocks it reads with ``dict.get`` ("autotuning", "checkpoint", ...) accept any key.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from shardwise.config.fields import Bool, DeepSpeedSection, Int, PositiveInt, Section, Str


class FeatureSection(Section):
    """A DeepSpeed block switched on by "enabled"."""

    enabled: Bool = False


class LenientFeatureSection(FeatureSection):
    """A block DeepSpeed reads key by key: any other key is accepted, as DeepSpeed does."""

    model_config = ConfigDict(extra="allow", frozen=True, validate_default=False)


class CometSection(DeepSpeedSection, FeatureSection):
    samples_log_interval: Int = 100
    project: Str | None = None
    workspace: Str | None = None
    api_key: Str | None = None
    experiment_name: Str | None = None
    experiment_key: Str | None = None
    online: Bool | None = None
    mode: Str | None = None


class HybridEngineSection(DeepSpeedSection, FeatureSection):
    max_out_tokens: PositiveInt = 512
    inference_tp_size: Int = 1
    release_inference_cache: Bool = False
    pin_parameters: Bool = True
    tp_gather_partition_size: Int = 8
    enable_cuda_graph: Bool = False


class WeightQuantizationSection(DeepSpeedSection, FeatureSection):
    """DeepSpeed's training acts on this block in one place only: a non-empty "quantized_initialization" makes
    zero.Init quantize the weights it builds (whatever "enabled" says). "post_init_quant" is read only by its
    inference quantization call, which scripts make themselves; empty dicts are DeepSpeed's defaults (off)."""

    enabled: Bool = True
    num_bits: Int = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: Int = 1
    quantized_initialization: dict[str, Any] = Field(default_factory=dict)
    post_init_quant: dict[str, Any] = Field(default_factory=dict)

    @property
    def acts(self) -> bool:
        """Whether DeepSpeed's training would quantize anything with this block."""
        return bool(self.quantized_initialization)


class CompileSection(DeepSpeedSection):
    """DeepSpeed's "compile" (DeepCompile): on when "deepcompile" is true; its other knobs only tune it."""

    deepcompile: Bool = False
    autoep_non_moe: Any = None
    free_activation: Any = None
    free_activation_threshold: Any = None
    offload_activation: Any = None
    offload_activation_pin_memory: Any = None
    offload_opt_states: Any = None
    double_buffer: Any = None
    symmetric_memory: Any = None
    debug_log: Any = None
    offload_parameters: Any = None
    sync_before_reduce: Any = None
    sync_after_reduce: Any = None
    sync_before_allgather: Any = None
    sync_after_allgather: Any = None
    keep_int_input_tensors: Any = None
    keep_all_input_tensors: Any = None
    passes: Any = None


class CheckpointSection(Section):
    """DeepSpeed's "checkpoint": read with dict.get; two values are checked."""

    model_config = ConfigDict(extra="allow", frozen=True, validate_default=False)
    tag_validation: Str = "Warn"
    parallel_write: dict[str, Any] = Field(default_factory=dict)

    @field_validator("tag_validation")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        if value.upper() not in ("IGNORE", "WARN", "FAIL"):
            raise ValueError('expected "Ignore", "Warn" or "Fail"')
        return value

    @field_validator("parallel_write")
    @classmethod
    def _pipeline_stage_is_a_bool(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("pipeline_stage", False) not in (True, False):
            raise ValueError('"pipeline_stage" must be true or false')
        return value


# data_types keys and the values that leave DeepSpeed's numerics unchanged (its defaults).
DATA_TYPES_DEFAULTS: dict[str, Any] = {"grad_accum_dtype": None, "param_dtype": None, "buffer_dtype": None,
                                       "keep_in_fp32_modules": "auto"}

# Top-level DeepSpeed keys whose only effect is on things shardwise does not have (logs, timers, NVMe I/O
# tuning): accepted with one warning when given. The "checkpoint" block is judged key by key
# (`checkpoint_no_effect_warnings`): its tag_validation is enforced.
NO_EFFECT_KEYS = ("aio", "timers", "log_level", "dump_state", "disable_python_gc",
                  "disable_allgather", "managed_gradient_accumulation", "use_data_before_expert_parallelism",
                  "seq_parallel_communication_data_type")

# Blocks that do something only while switched on; their fields in the schema, and how "on" is read.
FEATURE_BLOCKS = ("comet", "autotuning", "hybrid_engine", "data_efficiency", "torch_autocast",
                  "weight_quantization", "compile", "datastates_ckpt")


class DeepSpeedOnlyKeys(Section):
    """The DeepSpeed top-level keys of this module, as fields of the whole config (mixed into `ConfigModel`)."""

    comet: CometSection | None = None
    autotuning: LenientFeatureSection | None = None
    hybrid_engine: HybridEngineSection | None = None
    data_efficiency: LenientFeatureSection | None = None
    torch_autocast: LenientFeatureSection | None = None
    weight_quantization: WeightQuantizationSection | None = None
    compile: CompileSection | None = None
    datastates_ckpt: Any = None
    data_types: dict[str, Any] | None = None
    aio: dict[str, Any] | None = None
    checkpoint: CheckpointSection | None = None
    timers: dict[str, Any] | None = None
    log_level: Any = None
    dump_state: Bool = False
    disable_python_gc: Any = None
    disable_allgather: Bool = False
    managed_gradient_accumulation: Bool = True
    use_data_before_expert_parallelism: Bool = False
    seq_parallel_communication_data_type: Literal["fp16", "bf16", "fp32"] | None = None
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    sequence_parallel_size: PositiveInt = 1

    @field_validator("seq_parallel_communication_data_type", "gradient_allreduce_op", mode="before")
    @classmethod
    def _lowercase(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _misspelled_enabled(self) -> "DeepSpeedOnlyKeys":
        # DeepSpeed never looks at unknown keys of these blocks, so "enabeld": true would silently leave the
        # feature off; a near miss of "enabled" is taken for that typo.
        for name in ("autotuning", "data_efficiency", "torch_autocast"):
            block = getattr(self, name)
            for key in (block.model_extra or {}) if block is not None else ():
                if key != "enabled" and difflib.SequenceMatcher(None, key.lower(), "enabled").ratio() >= 0.8:
                    raise ValueError(f'"{name}.{key}": unknown key: did you mean "enabled"? (DeepSpeed would ignore '
                                     f'it and leave {name} off)')
        return self


def enabled_blocks(model: DeepSpeedOnlyKeys) -> list[str]:
    """The feature blocks of `model` that are switched on, in `FEATURE_BLOCKS` order."""
    on = []
    for name in FEATURE_BLOCKS:
        block = getattr(model, name)
        if name == "datastates_ckpt":
            # DeepSpeed: on whenever present and not literally false.
            active = block is not None and block is not False
        elif name == "compile":
            active = block is not None and block.deepcompile
        elif name == "weight_quantization":
            active = block is not None and block.acts
        else:
            active = block is not None and block.enabled
        if active:
            on.append(name)
    return on


def data_types_changed(model: DeepSpeedOnlyKeys) -> list[str]:
    """The "data_types" keys set to something other than DeepSpeed's default."""
    given = model.data_types or {}
    return [k for k, default in DATA_TYPES_DEFAULTS.items() if k in given and given[k] != default]


# "checkpoint" keys DeepSpeed reads that change nothing here, and why.
CHECKPOINT_NO_EFFECT = {
    "load_universal": "shardwise recognises a universal checkpoint (ds_to_universal.py output) by its files",
    "use_node_local_storage": "it picks which rank of each node writes DeepSpeed's shared files; the files "
                              "are the same",
    "parallel_write": "it spreads the writing of the same layer files over data-parallel ranks",
}


def checkpoint_no_effect_warnings(block: CheckpointSection | None) -> list[str]:
    """One line per given "checkpoint" key other than tag_validation (which save_checkpoint enforces): those
    DeepSpeed reads but that change nothing here, and those DeepSpeed never reads."""
    if block is None:
        return []
    given = sorted((block.model_fields_set | set(block.model_extra or {})) - {"tag_validation"})
    return [f'"checkpoint.{key}" has no effect in shardwise ({CHECKPOINT_NO_EFFECT[key]}); ignored'
            if key in CHECKPOINT_NO_EFFECT else
            f'"checkpoint.{key}" is not a key DeepSpeed reads; ignored (DeepSpeed ignores it too)' for key in given]


def no_effect_warnings(model: DeepSpeedOnlyKeys) -> list[str]:
    """One line per given DeepSpeed key that is accepted but changes nothing in shardwise."""
    lines = []
    for name in NO_EFFECT_KEYS:
        if name in model.model_fields_set:
            lines.append(f'"{name}" is a DeepSpeed setting with no effect in shardwise (nothing it tunes exists '
                         f'here); ignored')
    lines += checkpoint_no_effect_warnings(model.checkpoint)
    quantization = model.weight_quantization
    if quantization is not None and not quantization.acts and quantization.post_init_quant:
        lines.append('"weight_quantization.post_init_quant" is applied only by DeepSpeed\'s inference quantization '
                     'call, which shardwise does not have; ignored')
    extra = [k for k in (model.data_types or {}) if k not in DATA_TYPES_DEFAULTS]
    for key in extra:   # DeepSpeed reads data_types with dict.get and never looks at other keys
        lines.append(f'"data_types.{key}" is not a key DeepSpeed reads; ignored (DeepSpeed ignores it too)')
    return lines
