"""Pydantic schema of the config JSON: DeepSpeed's keys (names and defaults from DeepSpeed 0.19) and shardwise's
own blocks, as `ConfigModel`; the "zero_optimization", monitoring and DeepSpeed-only blocks have their own modules.

A validated block is frozen and is itself the section the code reads (`EngineConfig.pipeline` is the validated
"pipeline" block); `resolved.py` derives the few sections that are no single block. Unknown keys inside a block
are errors, as in DeepSpeed; unknown top-level keys are sorted out before the schema (`top_level.py`).
"""

from __future__ import annotations

import difflib
import enum
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from shardwise.config.deepspeed_blocks import DeepSpeedOnlyKeys
from shardwise.config.fields import (
    Bool, DeepSpeedSection, Float, Int, NonNegativeFloat, NonNegativeInt, PositiveInt, Section, Str, deepspeed_scalar,
)
from shardwise.config.monitoring import MonitoringConfig
from shardwise.config.zero import ZeroConfig


class AllReduceImpl(enum.StrEnum):
    """How the data-parallel gradient all-reduce is done."""

    BACKEND = "backend"   # the process group's own all_reduce (NCCL/gloo)
    RING = "ring"         # shardwise's ring (reduce-scatter + all-gather over p2p), for study and tests
    SHM = "shm"           # shardwise's shared-memory all-reduce: CPU tensors, the whole group on one host
    AUTO = "auto"         # SHM where it can serve, else BACKEND: the DDP wrapper's default, not a config value


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


class ContextParallelImpl(enum.StrEnum):
    """How attention runs over a sequence split across the context-parallel ranks."""

    RING = "ring"          # keys and values travel round the cp ranks; causal load balancing over 2 * size chunks
    ULYSSES = "ulysses"    # all-to-all from sequence-split to head-split and back (DeepSpeed's Ulysses)


class FP16Section(DeepSpeedSection):
    """Mixed precision with fp16 weights/activations and loss scaling (DeepSpeed's "fp16")."""

    enabled: Bool = False
    auto_cast: Bool = False
    """Cast the floating-point inputs of forward() to fp16."""
    loss_scale: NonNegativeFloat = 0.0
    """0 = dynamic loss scaling; > 0 = this fixed scale."""
    initial_scale_power: Int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: Int = 1000
    """Overflow-free steps before the dynamic scale doubles."""
    hysteresis: Int = 2
    """Overflows tolerated before the dynamic scale halves."""
    consecutive_hysteresis: Bool = False
    """Refill the hysteresis budget after every overflow-free step."""
    min_loss_scale: Int = 1
    """Floor of the dynamic scale."""
    fp16_master_weights_and_grads: Bool = False

    @model_validator(mode="after")
    def _dynamic_scaling_rules(self) -> "FP16Section":
        # As DeepSpeed: checked only when they take effect (fp16 on, dynamic scaling).
        if self.enabled and self.loss_scale == 0:
            if self.loss_scale_window <= 0:
                raise ValueError(f'"fp16.loss_scale_window": {self.loss_scale_window} must be > 0 with dynamic '
                                 f'loss scaling (loss_scale 0)')
            if self.min_loss_scale <= 0:
                raise ValueError(f'"fp16.min_loss_scale": {self.min_loss_scale} must be > 0 with dynamic '
                                 f'loss scaling (loss_scale 0)')
            if self.hysteresis <= 0:
                # DeepSpeed accepts 0 but then never lowers the scale after an overflow.
                raise ValueError(f'"fp16.hysteresis": {self.hysteresis} must be >= 1 (the number of overflows '
                                 f'tolerated before the scale is halved)')
        return self


class BF16Section(DeepSpeedSection):
    """bfloat16 weights/activations with fp32 master weights (DeepSpeed's "bf16", alias "bfloat16")."""

    enabled: Bool = False
    immediate_grad_update: Bool = False
    check_grad_overflow: Bool = True
    """Skip the optimizer step when a gradient is inf/nan."""
    bf16_master_weights_and_grads: Bool = False
    bf16_optimizer_states: Bool = False


class OptimizerSpec(Section):
    """An optimizer by DeepSpeed name ("Adam", "AdamW", ...) or any torch.optim class name. `params` is the
    config's own copy; treat it as read-only."""

    type: Str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: Bool = False
    """DeepSpeed's legacy FusedAdam fp16 path; accepted and ignored."""


class SchedulerSpec(Section):
    """A learning-rate schedule by DeepSpeed name ("WarmupLR", ...) or torch.optim.lr_scheduler name."""

    type: Str
    params: dict[str, Any] = Field(default_factory=dict)


class ActivationCheckpointingConfig(Section):
    """DeepSpeed's activation-checkpointing keys plus shardwise's "policy"."""

    policy: RecomputePolicy = RecomputePolicy.NONE
    """shardwise: which activations to recompute in backward. "none" keeps all; "full" keeps only each
    transformer block's input and recomputes the block; "selective" recomputes only the attention core
    (scores, softmax, its dropout, attention over V); "every_n" recomputes whole blocks, every N-th one
    ("every") or the first K of each pipeline stage ("blocks")."""
    every: PositiveInt | None = None
    """shardwise, policy "every_n": recompute blocks N, 2N, ... (1-based) of each stage."""
    blocks: NonNegativeInt | None = None
    """shardwise, policy "every_n": recompute the first K blocks of each stage (Megatron's "block" method)."""

    partition_activations: Bool = False
    """DeepSpeed: each TP rank keeps 1/t of every stored block input, all-gathered before the replay (no effect
    under sequence parallelism, whose block inputs are already split over TP, or without TP)."""
    number_checkpoints: PositiveInt | None = None
    """DeepSpeed: checkpoints per forward, sizing the contiguous buffer; accepted, with no effect (see below)."""
    contiguous_memory_optimization: Bool = False
    """DeepSpeed: copy partitions into one pre-sized buffer against fragmentation; accepted with a warning and no
    effect: torch's caching allocator reuses the equal-sized partition blocks."""
    cpu_checkpointing: Bool = False
    """DeepSpeed: keep stored block inputs in host memory (pinned on CUDA), copied back for the replay."""
    synchronize_checkpoint_boundary: Bool = False
    """DeepSpeed: synchronize the device at the start and end of each checkpoint's forward and replay."""
    profile: Bool = False
    """DeepSpeed: time each checkpoint's forward and replay (`shardwise.checkpointing.profile_times()`)."""

    @model_validator(mode="after")
    def _every_n_knobs(self) -> "ActivationCheckpointingConfig":
        given = [k for k in ("every", "blocks") if getattr(self, k) is not None]
        if self.policy == "every_n" and len(given) != 1:
            raise ValueError('policy "every_n" takes exactly one of "every" (every N-th block) and "blocks" (the '
                             'first K blocks of each stage); give one')
        if self.policy != "every_n" and given:
            raise ValueError(f'"{given[0]}" goes with policy "every_n" (the policy is "{self.policy}"); set '
                             f'"policy": "every_n" or remove it')
        return self


class CommunicationSection(Section):
    """shardwise: how collectives are carried out."""

    all_reduce: Literal[AllReduceImpl.BACKEND, AllReduceImpl.RING, AllReduceImpl.SHM] = AllReduceImpl.BACKEND
    """Data-parallel gradient all-reduce: "backend" calls the process group's all_reduce (NCCL/gloo);
    "ring" runs shardwise's own ring algorithm (reduce-scatter then all-gather over point-to-point
    sends), bit-for-bit comparable and instrumented, mainly for study and tests; "shm" sums CPU gradients
    through shared memory (/dev/shm) when every rank of the data-parallel group runs on one host, cheaper
    than gloo's loopback sockets."""
    timeout_minutes: Float = Field(5.0, gt=0)
    """How long a collective may wait for its peers before every rank reports what it waits on and the run ends
    naming the ranks that did not arrive (torch's default is 30 minutes). Fractions are fine (0.05 = 3 s)."""
    desync_check: Bool = True
    """Compare, once per step, the sequence of collectives every rank ran (one tiny all-reduce of a running
    hash): ranks that drift apart (a skipped step, backward without step) stop with an error naming the first
    differing operation instead of pairing collectives of different steps."""


class NonFiniteConfig(Section):
    """shardwise: what happens to a step whose loss or gradients are inf/nan."""

    skip_step: Bool = True
    """fp32: skip the optimizer step (as fp16/bf16 skip an overflowing one) instead of writing inf/nan into the
    weights. bf16 follows bf16.check_grad_overflow; fp16 always skips."""
    max_consecutive_skips: NonNegativeInt = 10
    """End the run after this many optimizer steps in a row were skipped (0 = never). Under dynamic fp16 loss
    scaling the steps the scale needs to come down from its initial value are added on top."""


class TensorParallelConfig(DeepSpeedSection):
    """shardwise: Megatron-style tensor parallelism. DeepSpeed's "autotp_size" is accepted for "size"."""

    size: PositiveInt = 1
    """Ranks that split each linear layer (consecutive ranks, ideally one node); 1 = off."""
    sequence_parallel: Bool = False
    """Also split the layer-norm/dropout activations along the sequence over the tensor-parallel
    group (needs size > 1)."""
    # DeepSpeed's AutoTP keys: how its engine picks and splits layers. shardwise's own plans do that, so these
    # are accepted and ignored (config/ignored.py warns); "autotp_size" is "size".
    dtype: Any = None
    tp_overlap_comm: Any = None
    vocab_parallel_lm_head: Any = None
    vocab_parallel_ce_backend: Any = None
    tensor_parallel: Any = None
    injection_policy_tuple: Any = None
    partition_config: Any = None
    preset_model: Any = None
    keep_module_on_host: Any = None
    replace_with_kernel_inject: Any = None

    @model_validator(mode="before")
    @classmethod
    def _autotp_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "autotp_size" in data:
            data = dict(data)
            if "size" in data:
                raise ValueError('give only one of "tensor_parallel.size" and "tensor_parallel.autotp_size"')
            value = deepspeed_scalar(data.pop("autotp_size"), int)    # an int in DeepSpeed's lax model
            data["size"] = 1 if value == 0 and not isinstance(value, bool) else value  # DeepSpeed: 0 = off
        return data

    @model_validator(mode="after")
    def _sequence_parallel_needs_tp(self) -> "TensorParallelConfig":
        if self.sequence_parallel and self.size == 1:
            raise ValueError('"tensor_parallel.sequence_parallel": true needs "tensor_parallel.size" > 1')
        return self


class ContextParallelConfig(Section):
    """shardwise: context parallelism, one sequence split over `size` ranks (DeepSpeed's "sequence_parallel_size"
    is this block with impl "ulysses")."""

    size: PositiveInt = 1
    """Ranks sharing each sequence (each holds 1/size of its tokens); 1 = off."""
    impl: ContextParallelImpl = ContextParallelImpl.RING
    """"ring" (keys and values passed round the ranks) or "ulysses" (all-to-all to whole heads)."""


class ExpertParallelConfig(Section):
    """Expert parallelism: each MoE layer's experts split over `size` data-parallel ranks, tokens exchanged with
    all-to-all. DeepSpeed's AutoEP block is accepted as well: `{"enabled": true, "autoep_size": E}` is size E (off
    unless enabled, as DeepSpeed reads it); its other keys, which pick and tune the layers AutoEP replaces in a
    Hugging Face model, are accepted and ignored (config/ignored.py warns)."""

    model_config = ConfigDict(extra="allow", frozen=True, validate_default=False)

    size: PositiveInt = 1
    """Ranks sharing one MoE layer's experts (each holds num_experts / size); must divide the data-parallel size.
    1 = off: every rank holds every expert."""
    expert_tensor_parallel_size: PositiveInt = 1
    """DeepSpeed AutoEP's tensor parallelism inside each expert; only 1 (none) is implemented."""

    @model_validator(mode="before")
    @classmethod
    def _autoep_spelling(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        enabled = data.pop("enabled", None)
        for key in data:     # DeepSpeed ignores unknown keys: "enabeld": true would silently leave the block off
            if key not in cls.model_fields and difflib.SequenceMatcher(None, key.lower(), "enabled").ratio() >= 0.8:
                raise ValueError(f'"expert_parallel.{key}": unknown key: did you mean "enabled"?')
        if "autoep_size" in data:
            if "size" in data:
                raise ValueError('give only one of "expert_parallel.size" and "expert_parallel.autoep_size"')
            data["size"] = data.pop("autoep_size")
        if enabled is not None:
            if not isinstance(enabled, bool):
                raise ValueError(f'"expert_parallel.enabled" = {enabled!r}: use true or false')
            if not enabled:          # DeepSpeed leaves the block off whatever its size says
                data["size"] = 1
        return data

    @model_validator(mode="after")
    def _expert_tp_not_implemented(self) -> "ExpertParallelConfig":
        if self.expert_tensor_parallel_size != 1:
            raise ValueError(f'"expert_parallel.expert_tensor_parallel_size" = {self.expert_tensor_parallel_size}: '
                             f'tensor parallelism inside experts is not implemented; use 1')
        return self


class PipelineConfig(Section):
    """shardwise: pipeline parallelism."""

    stages: PositiveInt = 1
    """Pipeline stages, each a contiguous slice of the transformer blocks on its own ranks; 1 = off."""
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    """Order of micro-batch forwards/backwards: "gpipe" (all forwards then all backwards), "1f1b"
    (warm up, then alternate; less activation memory), "interleaved_1f1b" (1F1B over
    virtual_stages chunks per rank; a smaller bubble for more communication)."""
    virtual_stages: PositiveInt = 1
    """Model chunks per pipeline rank; > 1 only with "interleaved_1f1b"."""
    partition: PipelinePartition = PipelinePartition.UNIFORM
    """How blocks are split over stages: "uniform" (same block count), "parameters" (balanced
    parameter count) or "flops" (balanced forward FLOPs)."""
    # DeepSpeed's pipeline keys. The first three tune its own engine's communication and seeding and change
    # no result; checkpointing every n layers is refused in unsupported.py unless 0 (off).
    seed_layers: Bool = False
    pipe_partitioned: Bool = True
    grad_partitioned: Bool = True
    activation_checkpoint_interval: NonNegativeInt = 0

    @model_validator(mode="after")
    def _virtual_stages_need_interleaving(self) -> "PipelineConfig":
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise ValueError(f'"pipeline.virtual_stages": {self.virtual_stages} needs "pipeline.schedule": '
                             f'"interleaved_1f1b" (got "{self.schedule}")')
        if self.schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            raise ValueError('"pipeline.schedule": "interleaved_1f1b" needs "pipeline.virtual_stages" >= 2')
        return self


class ConfigModel(DeepSpeedOnlyKeys, MonitoringConfig):
    """The whole config file: DeepSpeed's keys that shardwise acts on and its own blocks, plus (inherited) the
    monitoring keys and the DeepSpeed keys it accepts without acting on them."""

    train_batch_size: PositiveInt | None = None
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    gradient_accumulation_steps: PositiveInt | None = None
    memory_breakdown: Bool = False
    gradient_clipping: NonNegativeFloat = 1.0
    """Global gradient-norm clip; 0 = off. DeepSpeed 0.19's default is 1.0 (code, not docs)."""
    prescale_gradients: Bool = False
    gradient_predivide_factor: Float = Field(1.0, gt=0)
    fp16: FP16Section = Field(default_factory=FP16Section)
    bf16: BF16Section = Field(default_factory=BF16Section)
    optimizer: OptimizerSpec | None = None
    scheduler: SchedulerSpec | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    communication: CommunicationSection = Field(default_factory=CommunicationSection)
    nonfinite: NonFiniteConfig = Field(default_factory=NonFiniteConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    context_parallel: ContextParallelConfig = Field(default_factory=ContextParallelConfig)
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    # Harmless DeepSpeed keys that configs commonly carry.
    zero_allow_untested_optimizer: Bool = False
    zero_force_ds_cpu_optimizer: Bool = True
    communication_data_type: Literal["fp16", "bf16", "fp32"] | None = None
    dataloader_drop_last: Bool = False
    vocabulary_size: PositiveInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_spellings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "bfloat16" in data:  # DeepSpeed's old name for "bf16"
            if "bf16" in data:
                raise ValueError('give only one of "bf16" and "bfloat16" (the same block)')
            data["bf16"] = data.pop("bfloat16")
        if isinstance(data.get("zero_optimization"), bool):  # DeepSpeed's deprecated form
            data["zero_optimization"] = {"stage": 1 if data["zero_optimization"] else 0}
        ulysses = data.get("sequence_parallel_size")
        if isinstance(ulysses, int) and not isinstance(ulysses, bool) and ulysses > 1:   # DeepSpeed's Ulysses
            if "context_parallel" in data:
                raise ValueError('give only one of "sequence_parallel_size" (DeepSpeed\'s Ulysses) and '
                                 '"context_parallel"')
            data["context_parallel"] = {"size": ulysses, "impl": ContextParallelImpl.ULYSSES.value}
        return data

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _lowercase(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _precision_rules(self) -> "ConfigModel":
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError('"fp16.enabled" and "bf16.enabled" are both true: bfloat16 and fp16 modes cannot be '
                             'simultaneously enabled; enable one')
        stage = self.zero_optimization.stage
        for flag, on in (("fp16.fp16_master_weights_and_grads", self.fp16.fp16_master_weights_and_grads),
                         ("bf16.bf16_master_weights_and_grads", self.bf16.bf16_master_weights_and_grads),
                         ("bf16.bf16_optimizer_states", self.bf16.bf16_optimizer_states)):
            if on and stage == 0:
                raise ValueError(f'"{flag}": true is only supported with ZeRO stage 1, 2 or 3 '
                                 f'(zero_optimization.stage is 0)')
        if self.bf16.bf16_optimizer_states and not self.bf16.bf16_master_weights_and_grads:
            raise ValueError('"bf16.bf16_optimizer_states": true needs "bf16.bf16_master_weights_and_grads": true')
        return self
