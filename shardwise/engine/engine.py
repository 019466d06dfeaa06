"""The training engine: DeepSpeed's API over strategy objects chosen once at build time.

    loss = engine(batch)      # calls the model (tracks the activations it saves for backward)
    engine.backward(loss)     # loss / gradient_accumulation_steps (* fp16 loss scale); syncs grads on the boundary
    engine.step()             # on the boundary: optimizer step (unscale, overflow skip, clip), lr step, zero grads

The engine never asks which strategy runs. `shardwise.engine.initialize` builds the strategies once; the engine
holds each through the narrow view it calls (`parallel/interfaces.py`): `dp_runtime` around backward, `updater`
for the step, `pipeline` (a `BatchSchedule`) for a global batch. Counting micro-batches and steps is the step
driver's (`step.py`), which schedules drive too; checkpoints get a `CheckpointContext`, not the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from shardwise.checkpoint import save_load
from shardwise.checkpoint.context import CheckpointContext
from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.comm.sequence import SequenceCheck
from shardwise.comm.topology import Axis, ParallelMesh
from shardwise.comm.watchdog import HangWatchdog
from shardwise.config.resolved import EngineConfig
from shardwise.engine.deepspeed_api import DeepSpeedEngineAPI, PipelineEngineAPI
from shardwise.engine.skips import SkipGuard
from shardwise.engine.step import TrainingSteps
from shardwise.engine.engine_optimizer import with_deepspeed_members
from shardwise.errors import UserError
from shardwise.parallel.context.interface import BatchPart
from shardwise.parallel.experts.naming import with_expert_names
from shardwise.parallel.interfaces import (
    BatchSchedule, DataParallelRuntime, Pipeline, ShardedState, StageNaming, Updater, UpdateStrategy,
)
from shardwise.telemetry.monitor import TrainingMonitor
from shardwise.utils.timer import ThroughputTimer


class Engine(DeepSpeedEngineAPI, torch.nn.Module):
    """Built by `shardwise.initialize`; see the module docstring for the training loop. DeepSpeed's smaller
    accessors (batch sizes, ranks, no_sync, ...) come from `DeepSpeedEngineAPI`. An `nn.Module` whose one child is
    `module`, as DeepSpeed's engine: `engine.named_parameters()` and `engine.state_dict()` name tensors
    "module.<name>", `engine.to(...)` and `isinstance(engine, nn.Module)` work as scripts expect."""

    def __init__(self, *, module: torch.nn.Module, config: EngineConfig, mesh: ParallelMesh, update: UpdateStrategy,
                 dp_runtime: DataParallelRuntime, pipeline: Pipeline, lr_scheduler: Any, ledger: CommLedger,
                 device: torch.device, compute_dtype: torch.dtype, monitor: TrainingMonitor,
                 sequence_check: SequenceCheck | None = None, watchdog: HangWatchdog | None = None,
                 batch_part: BatchPart | None = None, data_mesh: ParallelMesh | None = None):
        # Under a pipeline `module` is this rank's stage and train_batch is the only way to train (the schedule
        # interleaves the micro-batches' forwards and backwards); with tensor parallelism it holds TP slices.
        torch.nn.Module.__init__(self)
        self.module = module
        self.mesh = mesh
        self.config = config
        self.pipeline: BatchSchedule = pipeline
        self.updater: Updater = update
        self.dp_runtime = dp_runtime
        self.lr_scheduler = lr_scheduler
        self.ledger = ledger
        self.monitor = monitor
        """DeepSpeed's monitors, progress lines, timers, comms logger and flops profiler (`shardwise.telemetry`)."""
        self.data_mesh = data_mesh or mesh
        """The mesh as the data sees it: with context parallelism `mesh` folds cp into dp (the parameters' view:
        gradients, shards, checkpoints), this one keeps cp apart, so dp_size, dp_rank and data_parallel_group are
        the plain data-parallel ones, as DeepSpeed reports them under sequence_parallel_size."""
        self.dp_comm: Comm = self.data_mesh.comm(Axis.DP, ledger, name="dp")
        self.metrics_comm: Comm = mesh.comm(Axis.DP, ledger, name="dp:metrics")
        self.tp_comm: Comm = mesh.comm(Axis.TP, ledger, name="tp:metrics")
        self.device = device
        self.compute_dtype = compute_dtype
        self.sequence_check = sequence_check
        """`comm.sequence.SequenceCheck`: all ranks ran the same collectives, verified as each step opens."""
        self.watchdog = watchdog
        """`comm.watchdog.HangWatchdog`: the report of a collective that outlived communication.timeout_minutes."""
        # Checkpoints name an MoE layer's experts by their global index (each ep rank holds other ones).
        self._naming: StageNaming = with_expert_names(module, pipeline)
        self._sharded_state: ShardedState = update
        self.steps = TrainingSteps(module=module, batch=config.batch, updater=update, dp_runtime=dp_runtime,
                                   lr_scheduler=lr_scheduler, ledger=ledger, monitor=monitor,
                                   metrics_comm=self.metrics_comm, device=device,
                                   skips=SkipGuard(config, mesh.global_rank), sequence_check=sequence_check,
                                   batch_part=batch_part)
        """The step driver: counters, forward/backward/step, what pipeline schedules drive."""
        self.optimizer = with_deepspeed_members(update.optimizer, self.steps)
        """The updater's torch optimizer (the client's own object at stage 0), with DeepSpeed's wrapper members
        (`overflow`, `cur_scale`)."""
        # The loader `initialize(training_data=...)` built (set there), and the iterator train_batch() reads when
        # given none: DeepSpeed's PipelineEngine loop `for step in ...: engine.train_batch()`.
        self.training_dataloader: Any = None
        self._data_iterator: Iterator[Any] | None = None
        self.tput_timer = ThroughputTimer(batch_size=config.batch.train_batch_size)
        """DeepSpeed's throughput timer: each micro-batch timed from its forward to its step (`utils.timer`)."""

    # -- identity and counters ------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.dp_comm.rank

    @property
    def dp_size(self) -> int:
        return self.dp_comm.size

    @property
    def global_steps(self) -> int:
        return self.steps.global_steps

    @property
    def global_samples(self) -> int:
        return self.steps.global_samples

    @property
    def micro_steps(self) -> int:
        return self.steps.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.steps.skipped_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.steps.is_gradient_accumulation_boundary()

    def get_lr(self) -> list[float]:
        return self.steps.get_lr()

    def was_step_applied(self) -> bool:
        return self.steps.step_applied

    @property
    def current_loss_scale(self) -> float:
        """The loss scale in force (fp16's dynamic scale moves; 1.0 without fp16). DeepSpeed's `loss_scale()` is
        the config's value."""
        return self.steps.loss_scale

    if not TYPE_CHECKING:     # at run time only: the type checker keeps flagging unknown engine members
        def __getattr__(self, name: str) -> Any:
            """A member the engine lacks is the model's (DeepSpeed's engine falls back to its module the same
            way): `engine.generate(...)`, `engine.gradient_checkpointing_enable()`, `engine.num_parameters()`."""
            modules = self.__dict__.get("_modules", {})
            if name in modules:                     # nn.Module's own lookup: the child `module`
                return modules[name]
            module = modules.get("module")
            if module is None or name.startswith("__"):
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"neither the engine nor its module ({type(module).__name__}) has an "
                                     f"attribute {name!r}") from None

    # -- forward / backward / step ------------------------------------------------------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Call the model. A single tuple/list (dict) argument is unpacked into positional (keyword)
        arguments when the model's forward takes more than one parameter, so `engine(batch)` works
        for `model(input_ids, labels)` as well as for `model(batch)`."""
        self.pipeline.refuse_manual_step("engine(batch)")
        if self.training_dataloader is None:    # DeepSpeed's rule: a loader it built times the batches instead
            self.tput_timer.start()
        return self.steps.forward(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        self.pipeline.refuse_manual_step("engine.backward(loss)")
        return self.steps.backward(loss, scale_wrt_gas)

    def step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.steps.step()
        self.tput_timer.stop(global_step=boundary)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients the data-parallel runtime holds, cleared (DeepSpeed's: set to None)."""
        self.dp_runtime.zero_grad()

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator `train_batch()` reads when called without one (DeepSpeed's PipelineEngine call)."""
        self._data_iterator = iterator

    def _default_iterator(self) -> Iterator[Any] | None:
        if self._data_iterator is None and self.training_dataloader is not None:
            self._data_iterator = repeating(self.training_dataloader)
        return self._data_iterator

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One global batch: gradient_accumulation_steps micro-batches from `data_iter` (default: the iterator
        of `set_dataiterator`, else the `initialize(training_data=...)` loader, restarted at its end), one optimizer
        step. Returns the loss averaged over micro-batches and data-parallel ranks, the same on every rank: a
        0-dim tensor, as DeepSpeed returns (`loss.item()`, `float(loss)`)."""
        if data_iter is None:
            data_iter = self._default_iterator()
        self.tput_timer.start()
        with self.monitor.global_batch(self.steps) as result:
            result.loss = self.pipeline.train_batch(self.steps, data_iter)
        self.tput_timer.stop(global_step=True)
        return _loss_value(result.loss)

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any], num_micro_batches: int | None = None) -> torch.Tensor:
        """The mean loss of `num_micro_batches` (default gradient_accumulation_steps) micro-batches from
        `data_iter`, in eval mode and without gradients, averaged over data-parallel ranks; the same number on
        every rank (DeepSpeed's PipelineEngine.eval_batch, also without a pipeline). Gradients, optimizer and
        step counters are untouched; the module's train/eval mode is restored. Collective."""
        count = self.gradient_accumulation_steps() if num_micro_batches is None else num_micro_batches
        if count < 1:
            raise UserError(f"engine.eval_batch: num_micro_batches = {count}; it must be >= 1")
        was_training = self.module.training
        self.module.eval()
        try:
            loss = self.pipeline.eval_batch(self.steps, data_iter, count)
        finally:
            self.module.train(was_training)
        self.monitor.eval_loss(self.steps, loss)
        return _loss_value(loss)

    # -- reports ------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes held by this rank: model parameters, gradient buffers, optimizer states (fp32 masters
        included), activations saved by the last forward, offload's pinned host staging buffers
        (`host_staging`, outside the model states), and the process's peak RSS."""
        held = self.updater.held_bytes()
        report = {"params": held.params, "grads": self.dp_runtime.grad_bytes, "optimizer": held.optimizer,
                  "activations": self.steps.activation_bytes}
        report["model_states"] = report["params"] + report["grads"] + report["optimizer"]
        report["host_staging"] = held.staging
        report["peak_rss"] = _peak_rss_bytes()
        if self.device.type == "cuda":
            report["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return report

    def comm_report(self, step: int | None = None) -> list[dict[str, Any]]:
        """The collectives of the last completed step (or `step`): op, group, group_size, dtype, count,
        bytes, seconds."""
        return self.ledger.report(self.steps.last_report_step if step is None else step)

    # -- checkpoints --------------------------------------------------------------------------------
    def checkpoint_context(self) -> CheckpointContext:
        """What the checkpoint code reads and restores of this engine."""
        return CheckpointContext(module=self.module, mesh=self.mesh, ledger=self.ledger, naming=self._naming,
                                 state=self._sharded_state, dp_runtime=self.dp_runtime,
                                 lr_scheduler=self.lr_scheduler, progress=self.steps,
                                 raw_config=self.config.raw, zero_stage=self.config.zero.stage,
                                 bf16=self.compute_dtype == torch.bfloat16,
                                 tag_validation=str((self.config.raw.get("checkpoint") or {})
                                                    .get("tag_validation", "Warn")))

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Collective: every rank calls it. DeepSpeed's files and keys, per model-parallel rank
        (`checkpoint.save_load`): DeepSpeed's load_checkpoint and zero_to_fp32.py read them. With save_latest=False
        the tag is written but `latest` keeps naming the tag it named; with exclude_frozen_parameters the
        parameters that do not require grad are left out of the model states (load them with
        load_module_strict=False, as with DeepSpeed)."""
        return save_load.save(self.checkpoint_context(), save_dir, tag, client_state, save_latest=save_latest,
                              exclude_frozen=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
        """Returns (checkpoint path, client_state), or (None, None) when `load_dir` holds no checkpoint."""
        return save_load.load(self.checkpoint_context(), load_dir, tag, strict=load_module_strict,
                              load_optimizer_states=load_optimizer_states,
                              load_lr_scheduler_states=load_lr_scheduler_states,
                              load_module_only=load_module_only)

    def consolidated_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict under the single-process names, on world rank 0 (None elsewhere):
        ZeRO-3 shards, TP slices and pipeline stages assembled. Collective."""
        return save_load.consolidated_state_dict(self.checkpoint_context(), exclude_frozen=exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's name for `consolidated_state_dict`, which Hugging Face's Trainer and Accelerate call."""
        return self.consolidated_state_dict(exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The whole model's weights (ZeRO-3 shards, TP slices and pipeline stages assembled) in the training
        dtype, as one `torch.save`d state dict under the single-process names, written by rank 0. Collective.
        Unlike DeepSpeed, ZeRO-3 does not need stage3_gather_16bit_weights_on_model_save for it."""
        return save_load.save_16bit_model(self.checkpoint_context(), save_dir, save_filename,
                                          exclude_frozen_parameters)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name for `save_16bit_model`. Collective."""
        return self.save_16bit_model(save_dir, save_filename)

    def module_state_dict(self, destination: dict[str, Any] | None = None, prefix: str = "",
                          keep_vars: bool = False, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The module's own `state_dict()` on this rank (as DeepSpeed's: ZeRO-3 shards stay placeholders, a
        pipeline rank has its stage's; `consolidated_state_dict` gives the whole model), without the
        parameters that do not require grad when `exclude_frozen_parameters`."""
        state: dict[str, Any] = self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
        if destination is not None:         # torch's: the entries go into the caller's dict, which is returned
            destination.update(state)
            state = destination
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters():
                if not param.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def load_module_state_dict(self, checkpoint: dict[str, Any], strict: bool = True,
                               custom_load_fn: Callable[..., Any] | None = None, fetch_z3_params: bool = False,
                               z3_params_to_fetch: list[torch.nn.Parameter] | None = None,
                               allowed_missing_keys: list[str] | None = None) -> None:
        """DeepSpeed's: load `checkpoint["module"]` (a model-states dict, as a checkpoint file holds it) into the
        module, or hand it to `custom_load_fn(src=..., dst=module)`. `allowed_missing_keys` may be absent under
        `strict`. The optimizer then steps from the loaded weights (its fp32 masters are refreshed). ZeRO-3
        shards are gathered around the load whatever `fetch_z3_params` says (every rank loads the same dict;
        DeepSpeed would load into its empty placeholders without it). Collective under ZeRO-3."""
        from shardwise.zero import GatheredParameters
        if not isinstance(checkpoint, dict) or "module" not in checkpoint:
            raise UserError("engine.load_module_state_dict(checkpoint): pass the model-states dict with the state "
                            "dict under \"module\" (DeepSpeed's form), e.g. {\"module\": model_state_dict}")
        state = checkpoint["module"]
        params = list(self.module.parameters()) if z3_params_to_fetch is None else list(z3_params_to_fetch)
        with torch.no_grad(), GatheredParameters(params, modifier_rank=0):
            if custom_load_fn is not None:
                custom_load_fn(src=state, dst=self.module)
            else:
                result = self.module.load_state_dict(state, strict=strict and allowed_missing_keys is None)
                if strict and allowed_missing_keys is not None:
                    missing = sorted(set(result.missing_keys) - set(allowed_missing_keys))
                    if missing or result.unexpected_keys:
                        raise UserError(f"engine.load_module_state_dict: the state dict does not match the model "
                                        f"outside allowed_missing_keys: missing {missing}, unexpected "
                                        f"{sorted(result.unexpected_keys)}; pass strict=False to load what matches")
        self._sharded_state.sync_masters_from_model()

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.dp_runtime.close()
        self.pipeline.close()
        self.monitor.close()


DeepSpeedEngine = Engine
"""DeepSpeed's name, for scripts that check `isinstance(engine, deepspeed.DeepSpeedEngine)`."""


class PipelineEngine(PipelineEngineAPI, Engine):
    """The engine of a pipeline model (a `PipelineModule`, or pipeline.stages > 1), as DeepSpeed's PipelineEngine:
    the same engine, plus DeepSpeed's stage members (`is_first_stage()`, `stage_id`, `grid`, ...), its
    `set_dataloader(loader)` and `set_batch_fn(fn)`."""

    _batch_fn: Callable[[Any], Any] | None = None

    def set_dataloader(self, loader: Any) -> None:
        """The loader `train_batch()` reads when called without an iterator, restarted at its end."""
        self.training_dataloader = loader
        self._data_iterator = None

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Every batch read from the data (train_batch, eval_batch) goes through ``fn`` first, which returns the
        (inputs, labels) pair the stages read: DeepSpeed's hook for loaders that yield another shape."""
        self._batch_fn = fn

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        return super().train_batch(self._through_batch_fn(data_iter if data_iter is not None
                                                          else self._default_iterator()))

    def eval_batch(self, data_iter: Iterator[Any], num_micro_batches: int | None = None) -> torch.Tensor:
        fn = self._batch_fn
        return super().eval_batch(map(fn, data_iter) if fn is not None else data_iter, num_micro_batches)

    def _through_batch_fn(self, data_iter: Iterator[Any] | None) -> Iterator[Any] | None:
        fn = self._batch_fn
        return map(fn, data_iter) if fn is not None and data_iter is not None else data_iter


def _loss_value(value: float) -> torch.Tensor:
    """A step's reported loss as DeepSpeed hands it back: a 0-dim tensor (float64 on the CPU: exactly the mean the
    ranks agreed on; no device sync is left to the caller)."""
    return torch.tensor(value, dtype=torch.float64)


def repeating(loader: Any) -> Iterator[Any]:
    """DeepSpeed's RepeatingLoader: the batches of ``loader``, started over at its end with the next epoch of its
    sampler (a DistributedSampler reshuffles per epoch)."""
    epoch = 0
    while True:
        set_epoch = getattr(getattr(loader, "sampler", None), "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise UserError("the training data gives no batch on this rank: it needs at least micro_batch x "
                            "data-parallel ranks samples (the loader drops an incomplete last batch)")
        epoch += 1


def _peak_rss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
