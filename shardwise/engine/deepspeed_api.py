"""DeepSpeed's smaller engine members, with DeepSpeed's kinds (attribute or method) and semantics.

`Engine` inherits `DeepSpeedEngineAPI`; everything here reads the engine's config, mesh and strategy objects:

    engine.local_rank, .global_rank, .world_size,          attributes (read-only properties)
        .dp_world_size, .mp_world_size
    engine.train_batch_size(), .train_micro_batch_size_per_gpu(), .gradient_accumulation_steps(), .get_batch_info()
    engine.set_train_batch_size(n)                         changes gradient accumulation steps only
    engine.set_train_micro_batch_size(n)                   changes the micro-batch (and so the global batch) only
    engine.set_gradient_accumulation_boundary(b)           the caller says which micro-batch ends the global batch
    engine.get_global_grad_norm(), .get_mom()              the last step's whole-model norm; betas or momentum
    engine.zero_optimization(), .zero_optimization_stage(), .zero_*() settings, .fp16_enabled(), ...
    engine.gradient_clipping(), .loss_scale(), .steps_per_print()   the config's values (methods, as DeepSpeed's)
    engine.get_data_parallel_rank(), .get_model_parallel_rank(), .get_tensor_parallel_rank()
    with engine.no_sync(): ...                             backward without gradient communication
    engine.empty_partition_cache(), engine.destroy()

`PipelineEngineAPI` adds DeepSpeed's PipelineEngine members (`is_first_stage()`, `stage_id`, `grid`, ...).
The kinds (attribute or method) follow DeepSpeed 0.19; tests/distributed/test_deepspeed_members.py checks each
against DeepSpeed itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist

from shardwise.comm.topology import Axis
from shardwise.config.batch import BatchSizes
from shardwise.config.resolved import DType
from shardwise.errors import NoSyncError, UserError

if TYPE_CHECKING:
    from shardwise.comm.collectives import Comm
    from shardwise.comm.sequence import SequenceCheck
    from shardwise.comm.topology import ParallelMesh
    from shardwise.config.resolved import EngineConfig
    from shardwise.config.zero import OffloadOptimizerConfig, OffloadParamConfig
    from shardwise.engine.step import TrainingSteps
    from shardwise.parallel.interfaces import BatchSchedule, DataParallelRuntime, Updater


class BatchSizeError(UserError, ValueError):
    """A batch size set_train_batch_size cannot take; a ValueError too, as DeepSpeed raises."""


# Optimizers whose momentum is a "momentum" entry of the param group (DeepSpeed's get_mom); others report "betas".
_MOMENTUM_OPTIMIZERS = ("SGD", "RMSprop")
# The optimizer types DeepSpeed builds itself, whose names its optimizer_name() reports in lower case.
_DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")


class DeepSpeedEngineAPI:
    """Mixin of `Engine`: DeepSpeed's accessors over the engine's state."""

    config: EngineConfig
    mesh: ParallelMesh
    data_mesh: ParallelMesh
    updater: Updater
    dp_runtime: DataParallelRuntime
    pipeline: BatchSchedule
    steps: TrainingSteps
    sequence_check: SequenceCheck | None
    dp_comm: Comm
    close: Callable[[], None]

    # -- identity: attributes in DeepSpeed --------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def local_rank(self) -> int:
        """The launcher's LOCAL_RANK (DeepSpeed reads the same variable); 0 for a plain single process."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def dp_world_size(self) -> int:
        return self.dp_comm.size

    @property
    def mp_world_size(self) -> int:
        """Ranks holding one copy of the model between them: the tensor-parallel size, times the pipeline stages
        when the model is a pipeline (DeepSpeed's PipelineEngine counts its grid's model group, stages included)."""
        return self.mesh.size(Axis.TP) * self.mesh.size(Axis.PP)

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """This rank's data-parallel process group (scripts average metrics over it)."""
        size = self.dp_comm.size
        if size == dist.get_world_size():
            world = dist.group.WORLD
            assert world is not None          # initialize made the default group
            return world
        if size == 1:
            # The mesh makes no group of one rank: it would cost a collective new_group per rank of the world.
            raise UserError("engine.data_parallel_group: the data-parallel size is 1 here, so there is no "
                            "data-parallel group to communicate over (a collective over it would be a no-op)")
        group = self.data_mesh.group(Axis.DP)
        assert group is not None
        return group

    def get_data_parallel_rank(self) -> int:
        return self.dp_comm.rank

    def get_model_parallel_rank(self) -> int:
        """This rank's index among the `mp_world_size` ranks of its model copy (stage-major, as DeepSpeed's grid)."""
        return self.mesh.rank(Axis.PP) * self.mesh.size(Axis.TP) + self.mesh.rank(Axis.TP)

    def get_tensor_parallel_rank(self) -> int:
        return self.mesh.rank(Axis.TP)

    # -- batch sizes ------------------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.config.batch.grad_accum

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's rule: the micro-batch stays, gradient accumulation steps become
        train_batch_size / (micro-batch * dp size). Call it between global batches."""
        micro, dp = self.config.batch.micro_batch, self.dp_comm.size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size < 1 \
                or train_batch_size % (micro * dp):
            raise BatchSizeError(f"set_train_batch_size({train_batch_size!r}): it must be a positive multiple of "
                                 f"train_micro_batch_size_per_gpu {micro} * data-parallel size {dp} = {micro * dp}")
        self._set_batch(BatchSizes(train_batch_size, micro, train_batch_size // (micro * dp), dp),
                        f"set_train_batch_size({train_batch_size})")

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's rule: gradient accumulation steps stay, the global batch becomes micro_batch_size *
        gradient_accumulation_steps * dp size. Call it between global batches."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise BatchSizeError(f"set_train_micro_batch_size({micro_batch_size!r}): it must be a positive integer")
        gas, dp = self.config.batch.grad_accum, self.dp_comm.size
        self._set_batch(BatchSizes(micro_batch_size * gas * dp, micro_batch_size, gas, dp),
                        f"set_train_micro_batch_size({micro_batch_size})")

    def _set_batch(self, batch: BatchSizes, call: str) -> None:
        if not self.steps.at_global_batch_start():
            raise UserError(f"{call}: called in the middle of a global batch (micro-batches since the last step); "
                            f"call it right after engine.step() on a boundary")
        old = self.config.batch
        if (batch.grad_accum, batch.micro_batch) != (old.grad_accum, old.micro_batch) \
                and self.pipeline.fixed_micro_batches:
            # A schedule was built for its micro-batch count and shapes: refuse rather than run the old ones.
            raise UserError(f"{call} would change the micro-batches per step to {batch.grad_accum} of "
                            f"{batch.micro_batch}, but the pipeline schedule was built for {old.grad_accum} of "
                            f"{old.micro_batch}: set the batch sizes in the config instead")
        # `raw`, saved in checkpoints as ds_config, keeps the config as given (DeepSpeed saves its dict unchanged).
        self.config = dataclasses.replace(self.config, batch=batch)
        self.steps.restart_cycle(self.config.batch)

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the next backward ends the global batch (True: it reduces gradients, and step() updates)
        instead of counting micro-batches against gradient_accumulation_steps; DeepSpeed's override, which
        Accelerate sets before every backward. It stays until set again; None counts micro-batches again."""
        self.steps.boundary_override = None if is_boundary is None else bool(is_boundary)

    # -- the config's values: methods in DeepSpeed ------------------------------------------------------
    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def loss_scale(self) -> float:
        """The config's fp16.loss_scale (0 = dynamic), as DeepSpeed's `loss_scale()`; the scale in force is
        `current_loss_scale`."""
        return self.config.precision.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self.config.precision.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        """2 ** fp16.initial_scale_power, whether or not fp16 is on (DeepSpeed's)."""
        power = self.config.precision.initial_scale_power
        return 1 << power if power >= 0 else 2.0 ** power

    def fp16_auto_cast(self) -> bool:
        return self.config.precision.auto_cast

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def memory_breakdown(self) -> bool:
        return self.config.memory_breakdown

    def dataloader_drop_last(self) -> bool:
        return self.config.dataloader_drop_last

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self.config.gradient_predivide_factor

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: communication_data_type, else the training dtype."""
        chosen = self.config.communication.data_type or self.config.precision.dtype
        dtype: torch.dtype = chosen.torch_dtype
        return dtype

    def optimizer_name(self) -> str | None:
        """The config's optimizer type (lower case for the optimizers DeepSpeed builds itself, as DeepSpeed
        reports them); the class name of an optimizer passed to initialize."""
        spec = self.config.optimizer
        if spec is None:
            return type(self.updater.optimizer).__name__
        return spec.type.lower() if spec.type.lower() in _DEEPSPEED_OPTIMIZERS else spec.type

    def optimizer_params(self) -> dict[str, Any] | None:
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict[str, Any] | None:
        return dict(self.config.scheduler.params) if self.config.scheduler is not None else None

    def get_mom(self) -> list[Any]:
        """Per param group: its "momentum" for SGD and RMSprop, else its "betas" (0.0 where the group has none)."""
        name = "momentum" if self.optimizer_name() in _MOMENTUM_OPTIMIZERS else "betas"
        return [group.get(name, 0.0) for group in self.updater.optimizer.param_groups]

    # -- precision and ZeRO -----------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.config.precision.dtype is DType.FP16

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.dtype is DType.BF16

    def zero_optimization(self) -> bool:
        return self.config.zero.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.config.zero.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.zero.stage >= 3

    def zero_offload_optimizer(self) -> OffloadOptimizerConfig | None:
        """The "offload_optimizer" block as given (None when absent), as DeepSpeed returns it."""
        return self.config.zero.offload_optimizer

    def zero_offload_param(self) -> OffloadParamConfig | None:
        return self.config.zero.offload_param

    def zero_cpu_offload(self) -> bool:
        block = self.config.zero.offload_optimizer
        return block is not None and block.device.value == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        block = self.config.zero.offload_optimizer
        return block is not None and block.device.value in ("cpu", "nvme")

    def zero_allow_untested_optimizer(self) -> bool:
        return self.config.zero_allow_untested_optimizer

    def zero_reduce_bucket_size(self) -> int:
        return self.config.zero.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero.allgather_bucket_size

    def zero_reduce_scatter(self) -> bool:
        return self.config.zero.reduce_scatter

    def zero_overlap_comm(self) -> bool:
        return self.config.zero.overlap_comm

    def zero_contiguous_gradients(self) -> bool:
        return self.config.zero.contiguous_gradients

    def zero_allgather_partitions(self) -> bool:
        return self.config.zero.allgather_partitions

    def zero_sub_group_size(self) -> int:
        return self.config.zero.sub_group_size

    def zero_prefetch_bucket_size(self) -> int:
        return self.config.zero.stage3_prefetch_bucket_size

    def zero_param_persistence_threshold(self) -> int:
        return self.config.zero.stage3_param_persistence_threshold

    def zero_model_persistence_threshold(self) -> int:
        return self.config.zero.stage3_model_persistence_threshold

    def zero_max_live_parameters(self) -> int:
        return self.config.zero.stage3_max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self.config.zero.stage3_max_reuse_distance

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's stage3_gather_16bit_weights_on_model_save (Accelerate reads it before asking for the
        consolidated weights; shardwise consolidates whatever it says)."""
        return self.config.zero.stage3_gather_16bit_weights_on_model_save

    def zero_load_from_fp32_weights(self) -> bool:
        return self.config.zero.load_from_fp32_weights

    def zero_elastic_checkpoint(self) -> bool:
        return self.config.zero.elastic_checkpoint

    def zero_ignore_unused_parameters(self) -> bool:
        return self.config.zero.ignore_unused_parameters

    def zero_round_robin_gradients(self) -> bool:
        return self.config.zero.round_robin_gradients

    def zero_hpz_partition_size(self) -> int:
        return self.config.zero.zero_hpz_partition_size

    def zero_compute_grad_norm(self) -> bool:
        return self.config.zero.compute_grad_norm

    def zero_parameter_alignment(self) -> bool:
        return self.config.zero.parameter_alignment

    def zero_legacy_stage1(self) -> bool:
        return self.config.zero.legacy_stage1

    def zero_quantized_weights(self) -> bool:
        return self.config.zero.zero_quantized_weights

    def zero_quantized_nontrainable_weights(self) -> bool:
        return self.config.zero.zero_quantized_nontrainable_weights

    def zero_quantized_gradients(self) -> bool:
        return self.config.zero.zero_quantized_gradients

    def zero_partial_offload(self) -> float:
        block = self.config.zero.offload_optimizer
        return block.ratio if block is not None else 1.0

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        return self.config.zero.use_multi_rank_bucket_allreduce

    def zero_allgather_sequential(self) -> bool:
        return self.config.zero.stage3_allgather_sequential

    def zero_module_granularity_threshold(self) -> int:
        return self.config.zero.stage3_module_granularity_threshold

    def zero_log_trace_cache_warnings(self) -> bool:
        return self.config.zero.log_trace_cache_warnings

    def get_global_grad_norm(self) -> float | None:
        """The whole model's gradient 2-norm at the last optimizer step (before clipping, after unscaling);
        inf when that step overflowed; None before the first step and with zero_optimization.compute_grad_norm
        false (as DeepSpeed's ZeRO 1-2). Computed whether or not gradient_clipping is on, as DeepSpeed's
        ZeRO and bf16/fp16 optimizers do (its stage-0 fp32 path, with no optimizer wrapper, gives None)."""
        return self.updater.last_grad_norm

    # -- gradient communication -------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communication, on the boundary too; the
        next backward outside on a boundary communicates the sum. engine.step() is refused inside. As in
        DeepSpeed, ZeRO stages 2 and 3 refuse it (they reduce-scatter every micro-batch to keep gradient
        shards only), and it does not nest."""
        if not self.dp_runtime.accumulates_locally:
            raise NoSyncError(f"engine.no_sync() does not work with ZeRO stage {self.config.zero.stage} (no_sync "
                              f"context manager is incompatible with gradient partitioning): its gradients are "
                              f"partitioned as they are produced; use zero_optimization.stage 0 or 1, or "
                              f"gradient_accumulation_steps instead of no_sync")
        with self.steps.no_sync():
            yield

    # -- memory and teardown ----------------------------------------------------------------------------
    def empty_partition_cache(self) -> None:
        """Free every gathered parameter (ZeRO-3 keeps only shards afterwards); nothing to free otherwise.
        Do not call it between a forward and its backward."""
        self.dp_runtime.release_gathered()

    def destroy(self) -> None:
        """Release the engine's hooks and helpers (DeepSpeed's destroy); the engine cannot train afterwards.
        Collective with the desync check on: a rank that ran fewer steps than the others is named here."""
        if self.sequence_check is not None:
            from shardwise.comm.sequence import END
            self.sequence_check.verify(self.steps.global_steps, kind=END)
        self.close()   # Engine's


class PipelineGrid:
    """DeepSpeed's `PipelineParallelGrid` as scripts read it (`engine.grid`): this rank's place along the
    pipeline, data-parallel and tensor-parallel ("slice") axes. Its "model parallel" group is every rank of one
    model copy (stages x tensor-parallel slices), as DeepSpeed's."""

    def __init__(self, mesh: ParallelMesh):
        self._mesh = mesh
        self.global_rank = mesh.global_rank
        self.world_size = mesh.shape.world_size
        self.pipe_parallel_size = mesh.size(Axis.PP)
        self.data_parallel_size = mesh.size(Axis.DP)
        self.model_parallel_size = mesh.size(Axis.TP)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = mesh.rank(Axis.PP)
        self.data_parallel_id = mesh.rank(Axis.DP)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.pp_group = mesh.shape.group_of(Axis.PP, self.global_rank)
        self.dp_group = mesh.shape.group_of(Axis.DP, self.global_rank)

    def _group(self, axis: Axis) -> dist.ProcessGroup | None:
        if self._mesh.size(axis) == 1:
            raise UserError(f"engine.grid: the {axis.value} axis has one rank, so it has no process group here; "
                            f"its rank is 0 and its size 1")
        return self._mesh.group(axis)

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int) -> int:
        """The global rank holding `stage_id` in this rank's pipeline."""
        return self.pp_group[stage_id]

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> dist.ProcessGroup | None:
        return self._group(Axis.PP)

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self._group(Axis.DP)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_group)

    def get_model_parallel_rank(self) -> int:
        return self.stage_id * self.slice_parallel_size + self._mesh.rank(Axis.TP)

    def get_model_parallel_world_size(self) -> int:
        return self.pipe_parallel_size * self.slice_parallel_size

    def get_slice_parallel_rank(self) -> int:
        return self._mesh.rank(Axis.TP)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> dist.ProcessGroup | None:
        return self._group(Axis.TP)

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size


class PipelineEngineAPI:
    """Mixin of `PipelineEngine`: DeepSpeed's PipelineEngine members, read from the mesh."""

    mesh: ParallelMesh
    config: EngineConfig

    @property
    def stage_id(self) -> int:
        return self.mesh.rank(Axis.PP)

    @property
    def num_stages(self) -> int:
        return self.mesh.size(Axis.PP)

    @property
    def prev_stage(self) -> int:
        return self.stage_id - 1

    @property
    def next_stage(self) -> int:
        return self.stage_id + 1

    @property
    def micro_batches(self) -> int:
        return self.config.batch.grad_accum

    @property
    def micro_batch_size(self) -> int:
        return self.config.batch.micro_batch

    @property
    def is_pipe_parallel(self) -> bool:
        return self.num_stages > 1

    @property
    def is_data_parallel(self) -> bool:
        return self.mesh.size(Axis.DP) > 1

    @property
    def is_model_parallel(self) -> bool:
        return self.mesh.size(Axis.TP) > 1

    @functools.cached_property
    def grid(self) -> PipelineGrid:
        return PipelineGrid(self.mesh)

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id
