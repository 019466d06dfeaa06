"""DeepSpeed's smaller engine members, with DeepSpeed's kinds (attribute or method) and semantics.

`Engine` inherits `DeepSpeedEngineAPI`; everything here reads the engine's config, mesh and strategy objects:

    engine.local_rank, engine.global_rank                  attributes (read-only properties)
    engine.train_batch_size(), .train_micro_batch_size_per_gpu(), .gradient_accumulation_steps()
    engine.set_train_batch_size(n)                         changes gradient accumulation steps only
    engine.get_global_grad_norm()                          the last step's whole-model norm (None before one)
    engine.zero_optimization_stage(), .fp16_enabled(), .bfloat16_enabled()
    with engine.no_sync(): ...                             backward without gradient communication
    engine.empty_partition_cache(), engine.destroy()
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING, Callable, Iterator

import torch.distributed as dist

from shardwise.config.batch import BatchSizes
from shardwise.config.resolved import DType
from shardwise.errors import UserError

if TYPE_CHECKING:
    from shardwise.comm.collectives import Comm
    from shardwise.comm.sequence import SequenceCheck
    from shardwise.config.resolved import EngineConfig
    from shardwise.engine.step import TrainingSteps
    from shardwise.parallel.interfaces import BatchSchedule, DataParallelRuntime, Updater


class BatchSizeError(UserError, ValueError):
    """A batch size set_train_batch_size cannot take; a ValueError too, as DeepSpeed raises."""


class DeepSpeedEngineAPI:
    """Mixin of `Engine`: DeepSpeed's accessors over the engine's state."""

    config: EngineConfig
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

    # -- batch sizes ------------------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.config.batch.grad_accum

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's rule: the micro-batch stays, gradient accumulation steps become
        train_batch_size / (micro-batch * dp size). Call it between global batches."""
        micro, dp = self.config.batch.micro_batch, self.dp_comm.size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size < 1 \
                or train_batch_size % (micro * dp):
            raise BatchSizeError(f"set_train_batch_size({train_batch_size!r}): it must be a positive multiple of "
                                 f"train_micro_batch_size_per_gpu {micro} * data-parallel size {dp} = {micro * dp}")
        if not self.steps.at_global_batch_start():
            raise UserError("set_train_batch_size: called in the middle of a global batch (micro-batches since the "
                            "last step); call it right after engine.step() on a boundary")
        gas = train_batch_size // (micro * dp)
        if gas != self.gradient_accumulation_steps() and self.pipeline.fixed_micro_batches:
            # A schedule was built for its micro-batch count: refuse rather than run the old count.
            raise UserError(f"set_train_batch_size({train_batch_size}) would change the micro-batches per step to "
                            f"{gas}, but the pipeline schedule was built for {self.gradient_accumulation_steps()}: "
                            f"set train_batch_size in the config instead")
        # `raw`, saved in checkpoints as ds_config, keeps the config as given (DeepSpeed saves its dict unchanged).
        self.config = dataclasses.replace(self.config, batch=BatchSizes(train_batch_size, micro, gas, dp))
        self.steps.restart_cycle(self.config.batch)

    # -- precision and ZeRO -----------------------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def fp16_enabled(self) -> bool:
        return self.config.precision.dtype is DType.FP16

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.dtype is DType.BF16

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
            raise UserError(f"engine.no_sync() does not work with ZeRO stage {self.config.zero.stage}: its gradients "
                            f"are partitioned as they are produced; use zero_optimization.stage 0 or 1, or "
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
