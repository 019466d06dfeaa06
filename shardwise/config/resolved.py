"""The frozen, internal form of a config: one small section per concern (DESIGN principle 7).

The pydantic models in `schema.py`/`zero.py` mirror the user's JSON; these dataclasses are what the
rest of shardwise reads. Each component gets only the section it needs. No torch import here (the
planner reads configs without torch); `DType.torch_dtype` imports it lazily.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from shardwise.config.batch import BatchSizes
from shardwise.config.monitoring import MonitoringConfig


class DType(enum.StrEnum):
    """Training dtype of the model weights and activations."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def torch_dtype(self) -> Any:
        import torch  # lazily: the config package must not need torch

        return {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}[self]


class AllReduceImpl(enum.StrEnum):
    """How the data-parallel gradient all-reduce is done."""

    BACKEND = "backend"   # the process group's own all_reduce (NCCL/gloo)
    RING = "ring"         # shardwise's ring (reduce-scatter + all-gather over p2p), for study and tests
    SHM = "shm"           # shardwise's shared-memory all-reduce: CPU tensors, the whole group on one host
    AUTO = "auto"         # SHM where it can serve, else BACKEND: the DDP wrapper's default, not a config value


class OffloadDevice(enum.StrEnum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class RecomputePolicy(enum.StrEnum):
    """Which activations are recomputed in backward instead of kept from forward."""

    NONE = "none"            # keep everything
    FULL = "full"            # keep only each block's input, recompute the whole block
    SELECTIVE = "selective"  # recompute only the attention core (scores, softmax, dropout, attention over V)
    EVERY_N = "every_n"      # recompute whole blocks: every N-th, or the first K of each stage


class PipelineSchedule(enum.StrEnum):
    GPIPE = "gpipe"                        # all forwards, then all backwards
    ONE_F_ONE_B = "1f1b"                   # warm-up forwards, then alternate forward/backward
    INTERLEAVED_1F1B = "interleaved_1f1b"  # 1F1B over several virtual stages per rank


class PipelinePartition(enum.StrEnum):
    UNIFORM = "uniform"        # the same number of transformer blocks per stage
    PARAMETERS = "parameters"  # balance the parameter count per stage
    FLOPS = "flops"            # balance the forward FLOPs per stage


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Dtype policy and loss scaling (DeepSpeed's "fp16"/"bf16" blocks)."""

    dtype: DType = DType.FP32
    auto_cast: bool = False
    """fp16.auto_cast: cast floating-point inputs of the model's forward to fp16."""
    loss_scale: float = 0.0
    """fp16.loss_scale as given: 0 means dynamic loss scaling, > 0 a fixed scale."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the dynamic scale is doubled."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved (DeepSpeed's delayed_shift)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget on every overflow-free step."""
    min_loss_scale: float = 1.0
    """The dynamic scale never drops below this."""
    bf16_immediate_grad_update: bool = False
    bf16_check_grad_overflow: bool = True
    """bf16: skip the step when a gradient is inf/nan (DeepSpeed's default since 0.16)."""

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
        """fp16 always skips a step whose gradients hold inf/nan; bf16 does when bf16_check_grad_overflow."""
        return self.dtype is DType.FP16 or (self.dtype is DType.BF16 and self.bf16_check_grad_overflow)


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """DeepSpeed's "optimizer" block: a type name (kept as the user spelled it) and its params.
    `params` is a private deep copy; treat it as read-only."""

    type: str
    params: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True, kw_only=True)
class SchedulerSpec:
    """DeepSpeed's "scheduler" block: a type name and its params (read-only copy)."""

    type: str
    params: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig:
    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: str | None = None
    buffer_count: int = 4
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = 1.0
    super_offload: bool = False
    cpuadam_cores_perc: float = 0.8


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig:
    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: str | None = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = True


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Every key of DeepSpeed's "zero_optimization" block, with DeepSpeed's defaults (see
    `shardwise/config/zero.py` for what each one means). Sizes count elements, not bytes."""

    stage: int = 0
    contiguous_gradients: bool = True
    overlap_comm: bool = False
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    sub_group_size: int = 1_000_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_model_persistence_threshold: int = 9_223_372_036_854_775_807
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_module_granularity_threshold: int = 0
    stage3_use_all_reduce_for_fetch_params: bool = False
    stage3_allgather_sequential: bool = False
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    zero_hpz_partition_size: int = 1
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module_classes: tuple[str, ...] = ()
    leaf_module_names: tuple[str, ...] = ()
    leaf_module_name_suffixes: tuple[str, ...] = ()

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer is not None and self.offload_optimizer.device is not OffloadDevice.NONE

    @property
    def offloads_params(self) -> bool:
        return self.offload_param is not None and self.offload_param.device is not OffloadDevice.NONE


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    """How gradients are communicated."""

    all_reduce: AllReduceImpl = AllReduceImpl.BACKEND
    data_type: DType | None = None
    """communication_data_type: dtype of reduced gradients; None = the gradients' own dtype."""
    timeout_minutes: float = 5.0
    """A collective waiting longer than this is reported (every rank's ledger) and ends the run."""
    desync_check: bool = True
    """Compare the ranks' sequences of collectives once per step."""

    @property
    def timeout_s(self) -> float:
        return self.timeout_minutes * 60.0


@dataclass(frozen=True, kw_only=True)
class NonFiniteConfig:
    """What a step with inf/nan loss or gradients does (shardwise's "nonfinite" block)."""

    skip_step: bool = True
    """fp32: skip such a step (fp16 always does; bf16 with bf16.check_grad_overflow)."""
    max_consecutive_skips: int = 10
    """End the run after this many skipped steps in a row; 0 = never."""


DEFAULT_BUCKET_BYTES = 25 << 20
"""Stage 0's gradient bucket when reduce_bucket_size is not set: torch DDP's bucket_cap_mb = 25."""


LAST_BUCKET_DIVISOR = 4
"""Stage 0's last-launched bucket holds at most 1/LAST_BUCKET_DIVISOR of the bucket size (its all-reduce
overlaps nothing; `parallel.data_parallel.plan_buckets`)."""


def gradient_bucket_numel(reduce_bucket_size: int | None, *, zero_stage: int, element_size: int) -> int:
    """Elements per gradient bucket as the engine builds them: zero_optimization.reduce_bucket_size when the
    config sets it; else `DEFAULT_BUCKET_BYTES` of gradients of `element_size` bytes at stage 0, DeepSpeed's
    default (`ZeroConfig.reduce_bucket_size`) at stages 1-3. The planner asks it for a config that sets none."""
    if reduce_bucket_size is not None:
        return reduce_bucket_size
    return DEFAULT_BUCKET_BYTES // element_size if zero_stage == 0 else ZeroConfig.reduce_bucket_size


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
class TensorParallelConfig:
    size: int = 1
    sequence_parallel: bool = False


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    stages: int = 1
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    virtual_stages: int = 1
    partition: PipelinePartition = PipelinePartition.UNIFORM


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig:
    policy: RecomputePolicy = RecomputePolicy.NONE
    every: int | None = None
    """policy every_n: recompute blocks N, 2N, ... (1-based) of each stage."""
    blocks: int | None = None
    """policy every_n: recompute the first K blocks of each stage."""
    partition_activations: bool = False
    number_checkpoints: int | None = None
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """A validated config with the batch triple resolved for one data-parallel size."""

    batch: BatchSizes
    precision: PrecisionConfig = PrecisionConfig()
    gradient_clipping: float = 1.0
    """Clip the global gradient norm to this; 0 = off. (DeepSpeed 0.19's default is 1.0.)"""
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    optimizer: OptimizerSpec | None = None
    scheduler: SchedulerSpec | None = None
    zero: ZeroConfig = ZeroConfig()
    communication: CommConfig = CommConfig()
    nonfinite: NonFiniteConfig = NonFiniteConfig()
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    pipeline: PipelineConfig = PipelineConfig()
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dataloader_drop_last: bool = False
    zero_allow_untested_optimizer: bool = False
    monitors: MonitoringConfig = MonitoringConfig()
    """The monitoring blocks; `steps_per_print` and `wall_clock_breakdown` are copied into it."""
    raw: dict[str, Any] = field(default_factory=dict, hash=False, compare=False, repr=False)
    """A deep copy of the config as given (plain JSON types), saved in checkpoints."""

    @property
    def data_parallel(self) -> DataParallelConfig:
        """Stage 0's section (the other stages refuse its non-default values: `config/unsupported.py`)."""
        given = "reduce_bucket_size" in (self.raw.get("zero_optimization") or {})
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


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
