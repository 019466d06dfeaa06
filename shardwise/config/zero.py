"""DeepSpeed's "zero_optimization" block: every key DeepSpeed 0.19 accepts, with its defaults; the validated
block is also the section the ZeRO code reads (`EngineConfig.zero`).

Sizes count elements, not bytes. Alternative and deprecated spellings are stored under one name, as DeepSpeed
stores them.
"""

from __future__ import annotations

import enum
import sys
from typing import Any

from pydantic import Field, field_validator, model_validator

from shardwise.config.fields import (
    Bool, DeepSpeedSection, Float, Int, NonNegativeInt, PositiveInt, Str, deepspeed_scalar, deepspeed_scalars,
)


class OffloadDevice(enum.StrEnum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class OffloadOptimizerConfig(DeepSpeedSection):
    """Optimizer state (and the optimizer step) in CPU or NVMe memory. DeepSpeed: stages 1-3."""

    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: Str | None = None
    buffer_count: NonNegativeInt = 4
    """NVMe buffer pool size; at least the number of per-parameter states (Adam: 4)."""
    pin_memory: Bool = True
    """Page-locked CPU memory: needed for asynchronous, full-bandwidth copies."""
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    fast_init: Bool = False
    ratio: Float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of optimizer states offloaded (< 1 only with stage 3)."""
    super_offload: Bool = False
    cpuadam_cores_perc: Float = Field(0.8, ge=0.0, le=1.0)

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's derived flag: either NVMe transfer overlaps the step (pipeline_read or pipeline_write)."""
        return self.pipeline_read or self.pipeline_write


class OffloadParamConfig(DeepSpeedSection):
    """Parameters in CPU or NVMe memory. DeepSpeed: stage 3 only."""

    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: Str | None = None
    buffer_count: NonNegativeInt = 5
    buffer_size: NonNegativeInt = 100_000_000
    max_in_cpu: NonNegativeInt = 1_000_000_000
    pin_memory: Bool = True


class LeafModuleConfig(DeepSpeedSection):
    """ZeRO-3: modules fetched as one unit (no hooks inside). A single string is taken as a list."""

    classes: tuple[Str, ...] = (
        "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    )
    names: tuple[Str, ...] = ()
    name_suffixes: tuple[Str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _single_string_is_a_list(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: [v] if k in ("classes", "names", "name_suffixes") and isinstance(v, str) else v
                    for k, v in data.items()}
        return data


OFFLOAD_MIN_STAGE = {"offload_optimizer": 1, "offload_param": 3}
"""The lowest ZeRO stage at which DeepSpeed acts on each offload block; below it the block is ignored."""


# Other spellings DeepSpeed accepts -> the stage3_ name it documents (and the sections store).
STAGE3_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}


def _move(data: dict[str, Any], old: str, new: str, value: Any) -> None:
    if new in data:
        raise ValueError(f'give only one of "zero_optimization.{old}" and "zero_optimization.{new}" '
                         f'(they are the same setting)')
    del data[old]
    data[new] = value


class ZeroConfig(DeepSpeedSection):
    """ZeRO: partition optimizer state (stage 1), + gradients (2), + parameters (3) over data parallel."""

    stage: Int = 0
    """0 = off (plain data parallel), 1 = optimizer states, 2 = + gradients, 3 = + parameters."""
    contiguous_gradients: Bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_scatter: Bool = True
    """Average gradients with reduce-scatter instead of all-reduce (stages 1-2)."""
    reduce_bucket_size: PositiveInt = 500_000_000
    """Elements reduced per collective; also the data-parallel gradient bucket size at stage 0."""
    use_multi_rank_bucket_allreduce: Bool = True
    allgather_partitions: Bool = True
    """Gather updated partitions with all-gather (true) or a series of broadcasts (false)."""
    allgather_bucket_size: NonNegativeInt = 500_000_000
    """Elements all-gathered per collective."""
    overlap_comm: Bool = False
    """Overlap gradient reduction with backward. Unset (or null): true at stage 3, false otherwise."""
    compute_grad_norm: Bool = True
    load_from_fp32_weights: Bool = True
    elastic_checkpoint: Bool = False
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    zenflow: dict[str, Any] | None = None
    """DeepSpeed's ZenFlow (stall-free offload); not implemented by shardwise."""
    sub_group_size: NonNegativeInt = 1_000_000_000
    stage3_prefetch_bucket_size: NonNegativeInt = 50_000_000
    stage3_param_persistence_threshold: NonNegativeInt = 100_000
    stage3_model_persistence_threshold: NonNegativeInt = sys.maxsize
    stage3_max_live_parameters: NonNegativeInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegativeInt = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: Bool = False
    stage3_module_granularity_threshold: Int = 0
    stage3_use_all_reduce_for_fetch_params: Bool = False
    stage3_allgather_sequential: Bool = False
    ignore_unused_parameters: Bool = True
    legacy_stage1: Bool = False
    round_robin_gradients: Bool = False
    parameter_alignment: Bool = False
    zero_hpz_partition_size: NonNegativeInt = 1
    zero_quantized_weights: Bool = False
    zero_quantized_nontrainable_weights: Bool = False
    zero_quantized_gradients: Bool = False
    memory_efficient_linear: Bool = True
    pipeline_loading_checkpoint: Bool = False
    override_module_apply: Bool = True
    log_trace_cache_warnings: Bool = False
    enable_sanity_checks: Bool = False
    save_muon_momentum_buffer_in_memory: Bool = False
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

    @model_validator(mode="before")
    @classmethod
    def _translate_spellings(cls, data: Any) -> Any:
        """Accept DeepSpeed's alternative and deprecated spellings, as DeepSpeed does."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in STAGE3_ALIASES.items():
            if old in data:
                _move(data, old, new, data[old])
        # Read as DeepSpeed reads them ("stage": "3" is 3) before the stage decides overlap_comm's default below.
        data = deepspeed_scalars(cls, data)
        for old in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):
            if old in data:
                data[old] = deepspeed_scalar(data[old], bool)
        # DeepSpeed: "cpu_offload": true means offload_optimizer on the CPU; false means nothing.
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if old in data:
                if not isinstance(data[old], bool):
                    raise ValueError(f'"zero_optimization.{old}" must be true or false, got {data[old]!r}')
                _move(data, old, new, {"device": "cpu"} if data[old] else data.get(new))
        if "cpu_offload_use_pin_memory" in data:  # DeepSpeed only warns about it; so do we (drop it)
            if not isinstance(data["cpu_offload_use_pin_memory"], bool):
                raise ValueError('"zero_optimization.cpu_offload_use_pin_memory" must be true or false')
            del data["cpu_offload_use_pin_memory"]
        if data.get("overlap_comm") is None:    # DeepSpeed's default depends on the stage
            data["overlap_comm"] = data.get("stage", 0) == 3
        return data

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, stage: int) -> int:
        if stage not in (0, 1, 2, 3):
            raise ValueError("ZeRO stage must be 0, 1, 2 or 3")
        return stage

    @model_validator(mode="after")
    def _deepspeed_rules(self) -> "ZeroConfig":
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ValueError('"zero_optimization.compute_grad_norm": false is supported only with ZeRO stage 1 or 2')
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1.0 and self.stage != 3:
            raise ValueError('"zero_optimization.offload_optimizer.ratio" < 1 (partial offload) needs ZeRO stage 3')
        return self

    @property
    def offloads_optimizer(self) -> bool:
        return self._offloads("offload_optimizer")

    @property
    def offloads_params(self) -> bool:
        return self._offloads("offload_param")

    def _offloads(self, name: str) -> bool:
        block = getattr(self, name)
        return block is not None and block.device is not OffloadDevice.NONE and self.stage >= OFFLOAD_MIN_STAGE[name]

    def effective(self) -> "ZeroConfig":
        """This block as the engine runs it: an offload block below the stage that uses it reads device "none",
        as DeepSpeed ignores it (`ignored.py` warns)."""
        off = {}
        for name, stage in OFFLOAD_MIN_STAGE.items():
            block = getattr(self, name)
            if block is not None and self.stage < stage:
                off[name] = block.model_copy(update={"device": OffloadDevice.NONE})
        return self.model_copy(update=off) if off else self


def _alias_of(field: str) -> property:
    return property(lambda self: getattr(self, field), doc=f"DeepSpeed's attribute name for `{field}`.")


# DeepSpeed's DeepSpeedZeroConfig names its stage-3 attributes without the "stage3_" prefix (the prefixed keys are
# its aliases); scripts reading `zero_config.gather_16bit_weights_on_model_save` read the same setting here.
for _name, _field in STAGE3_ALIASES.items():
    if not _name.startswith("stage3_"):
        setattr(ZeroConfig, _name, _alias_of(_field))
