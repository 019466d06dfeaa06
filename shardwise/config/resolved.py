"""`EngineConfig`: a validated config as the rest of shardwise reads it, one frozen section per concern.

Most sections are the validated blocks of the schema themselves (`cfg.pipeline` is the "pipeline" block); this
module writes only what no single block holds: the dtype policy, the communication settings, stage 0's section
and the gradient bucket size. No torch import (the planner reads configs without torch).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from shardwise.config.batch import BatchSizes
from shardwise.config.monitoring import MonitoringConfig
from shardwise.config.schema import (
    ActivationCheckpointingConfig, AllReduceImpl, BF16Section, CommunicationSection, ConfigModel, FP16Section,
    ContextParallelConfig, ExpertParallelConfig, NonFiniteConfig, OptimizerSpec, PipelineConfig, SchedulerSpec,
    TensorParallelConfig,
)
from shardwise.config.zero import ZeroConfig


class DType(enum.StrEnum):
    """Training dtype of the model weights and activations."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def torch_dtype(self) -> Any:
        import torch  # lazily: the config package must not need torch

        return {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}[self]


class PrecisionConfig(FP16Section):
    """The dtype policy: the dtype that "fp16"/"bf16" switch on, the "bf16" block, and (inherited) the "fp16" block,
    whose loss-scaling keys act only when the dtype is fp16."""

    dtype: DType = DType.FP32
    bf16: BF16Section = Field(default_factory=BF16Section)

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when fp16 trains with a dynamic loss scale (loss_scale == 0)."""
        return self.dtype is DType.FP16 and self.loss_scale == 0

    @property
    def static_loss_scale(self) -> float:
        """The fixed loss scale: fp16.loss_scale when > 0; 1.0 otherwise (bf16/fp32 never scale)."""
        return self.loss_scale if self.dtype is DType.FP16 and self.loss_scale > 0 else 1.0

    @property
    def initial_loss_scale(self) -> float:
        return 2.0 ** self.initial_scale_power if self.dynamic_loss_scale else self.static_loss_scale

    @property
    def checks_overflow(self) -> bool:
        """fp16 always skips a step whose gradients hold inf/nan; bf16 does when bf16.check_grad_overflow."""
        return self.dtype is DType.FP16 or (self.dtype is DType.BF16 and self.bf16.check_grad_overflow)


class CommConfig(CommunicationSection):
    """The "communication" block and DeepSpeed's top-level "communication_data_type"."""

    data_type: DType | None = None
    """The dtype gradients are reduced in; None = the gradients' own dtype."""

    @property
    def timeout_s(self) -> float:
        return self.timeout_minutes * 60.0


DEFAULT_BUCKET_BYTES = 25 << 20
"""Stage 0's gradient bucket when reduce_bucket_size is not set: torch DDP's bucket_cap_mb = 25."""


LAST_BUCKET_DIVISOR = 4
"""Stage 0's last-launched bucket holds at most 1/LAST_BUCKET_DIVISOR of the bucket size (its all-reduce
overlaps nothing; `parallel.data_parallel.plan_buckets`)."""


def gradient_bucket_numel(reduce_bucket_size: int | None, *, zero_stage: int, element_size: int) -> int:
    """Elements per gradient bucket as the engine builds them: zero_optimization.reduce_bucket_size when the
    config sets it; else `DEFAULT_BUCKET_BYTES` of gradients of `element_size` bytes at stage 0, DeepSpeed's
    default reduce_bucket_size at stages 1-3. The planner asks it for a config that sets none."""
    if reduce_bucket_size is not None:
        return reduce_bucket_size
    if zero_stage == 0:
        return DEFAULT_BUCKET_BYTES // element_size
    default: int = ZeroConfig.model_fields["reduce_bucket_size"].default
    return default


@dataclass(frozen=True, kw_only=True)
class DataParallelConfig:
    """What stage 0's bucketed gradient all-reduce reads: the "communication" block, DeepSpeed's
    prescale_gradients / gradient_predivide_factor and zero_optimization.reduce_bucket_size."""

    bucket_numel: int | None
    """Elements per gradient bucket: zero_optimization.reduce_bucket_size when the config sets it, else None:
    `DEFAULT_BUCKET_BYTES` in the gradients' dtype (DeepSpeed's default 5e8 elements leaves a 1B model ~3
    buckets, so the all-reduce hardly overlaps backward)."""
    all_reduce: AllReduceImpl = AllReduceImpl.BACKEND
    data_type: DType | None = None
    prescale: bool = False
    predivide_factor: float = 1.0


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """A validated config with the batch triple resolved for one data-parallel size. The top-level keys mean what
    `ConfigModel` says of them."""

    batch: BatchSizes
    precision: PrecisionConfig
    gradient_clipping: float
    prescale_gradients: bool
    gradient_predivide_factor: float
    optimizer: OptimizerSpec | None = field(hash=False)      # free-form params: a dict, not hashable
    scheduler: SchedulerSpec | None = field(hash=False)
    zero: ZeroConfig
    communication: CommConfig
    nonfinite: NonFiniteConfig
    tensor_parallel: TensorParallelConfig
    pipeline: PipelineConfig
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    activation_checkpointing: ActivationCheckpointingConfig
    memory_breakdown: bool
    dataloader_drop_last: bool
    zero_allow_untested_optimizer: bool
    monitors: MonitoringConfig
    raw: dict[str, Any] = field(default_factory=dict, hash=False, compare=False, repr=False)
    """A deep copy of the config as given (plain JSON types), saved in checkpoints."""

    # DeepSpeed's `engine.config` is the config dict as given; Hugging Face's Trainer reads it so
    # (`engine.config.get("zero_optimization", {}).get("stage")`). These read `raw` the same way.
    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    @property
    def steps_per_print(self) -> int | None:
        return self.monitors.steps_per_print

    @property
    def wall_clock_breakdown(self) -> bool:
        return self.monitors.wall_clock_breakdown

    @property
    def data_parallel(self) -> DataParallelConfig:
        """Stage 0's section (the other stages refuse its non-default values: `config/unsupported.py`)."""
        given = "reduce_bucket_size" in self.zero.model_fields_set
        return DataParallelConfig(bucket_numel=self.zero.reduce_bucket_size if given else None,
                                  all_reduce=self.communication.all_reduce,
                                  data_type=self.communication.data_type, prescale=self.prescale_gradients,
                                  predivide_factor=self.gradient_predivide_factor)

    def describe(self) -> dict[str, Any]:
        """Everything but `raw`, as plain JSON-ready values, for printing."""
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "raw"}
        out["batch"]["arithmetic"] = self.batch.arithmetic()
        precision = out["precision"]
        precision["dynamic_loss_scale"] = self.precision.dynamic_loss_scale
        precision["initial_loss_scale"] = self.precision.initial_loss_scale
        return out


def resolve(model: ConfigModel, batch: BatchSizes, raw: dict[str, Any]) -> EngineConfig:
    """The `EngineConfig` of a validated config whose batch triple resolved to `batch`."""
    fp16, bf16 = model.fp16, model.bf16
    dtype = DType.FP16 if fp16.enabled else DType.BF16 if bf16.enabled else DType.FP32
    data_type = model.communication_data_type
    return EngineConfig(
        batch=batch,
        precision=PrecisionConfig(**dict(fp16), dtype=dtype, bf16=bf16),
        gradient_clipping=model.gradient_clipping,
        prescale_gradients=model.prescale_gradients,
        gradient_predivide_factor=model.gradient_predivide_factor,
        optimizer=model.optimizer,
        scheduler=model.scheduler,
        zero=model.zero_optimization.effective(),
        communication=CommConfig(**dict(model.communication), data_type=DType(data_type) if data_type else None),
        nonfinite=model.nonfinite,
        tensor_parallel=model.tensor_parallel,
        pipeline=model.pipeline,
        context_parallel=model.context_parallel,
        expert_parallel=model.expert_parallel,
        activation_checkpointing=model.activation_checkpointing,
        memory_breakdown=model.memory_breakdown,
        dataloader_drop_last=model.dataloader_drop_last,
        zero_allow_untested_optimizer=model.zero_allow_untested_optimizer,
        monitors=MonitoringConfig(**{name: getattr(model, name) for name in MonitoringConfig.model_fields}),
        raw=raw,
    )


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
