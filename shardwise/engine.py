"""The training engine: DeepSpeed's API over strategy objects chosen once at build time.

    loss = engine(batch)      # calls the model (tracks the activations it saves for backward)
    engine.backward(loss)     # loss / gradient_accumulation_steps (* fp16 loss scale); syncs grads on the boundary
    engine.step()             # on the boundary: optimizer step (unscale, overflow skip, clip), lr step, zero grads

The engine holds no `if stage == ...` ladders: it calls three interfaces (`shardwise.interfaces`), whose
objects `shardwise.initialize` picks once: `dp_runtime` (what happens across data-parallel ranks around forward
and backward), `updater` (how the update is applied) and `pipeline` (how a global batch runs: the whole model,
or this rank's stage under a schedule). It holds the `ParallelMesh` the run was built on.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator

import torch

from shardwise import engine_checkpoint
from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.config.resolved import EngineConfig
from shardwise.engine_api import DeepSpeedEngineAPI
from shardwise.errors import UserError
from shardwise.interfaces import DataParallelRuntime, Pipeline, Updater
from shardwise.parallel.grad_norm import Riders
from shardwise.parallel.outputs import loss_of
from shardwise.telemetry.monitor import TrainingMonitor
from shardwise.telemetry.timers import BACKWARD, BACKWARD_ALLREDUCE, BACKWARD_INNER, STEP
from shardwise.skips import SkipGuard
from shardwise.topology import Axis, ParallelMesh


class _ActivationMeter:
    """Bytes of tensors autograd saves for backward during one forward, parameters excluded.
    Each storage counts once (views of one buffer are saved many times by some ops). Storages are told apart
    by their StorageImpl identity, which survives the resize-to-0-and-back of ZeRO-3's gathered buffers."""

    def __init__(self, params: list[torch.Tensor], extra_keys: Callable[[], set[int]]):
        self._extra_keys = extra_keys
        self.reset(params)

    def reset(self, params: list[torch.Tensor]) -> None:
        self._param_keys = {p.untyped_storage()._cdata for p in params} | self._extra_keys()
        self.bytes = 0
        self._seen: set[int] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):   # e.g. tensors without storage (meta, sparse)
            return t
        key = storage._cdata
        if key in self._seen or key in self._param_keys:
            return t
        if isinstance(t, torch.nn.Parameter) or key in self._extra_keys():   # ZeRO-3 buffers gathered meanwhile
            self._param_keys.add(key)
            return t
        self._seen.add(key)
        self.bytes += storage.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


class Engine(DeepSpeedEngineAPI):
    """Built by `shardwise.initialize`; see the module docstring for the training loop. DeepSpeed's smaller
    accessors (batch sizes, ranks, no_sync, ...) come from `DeepSpeedEngineAPI`."""

    def __init__(self, *, module: torch.nn.Module, config: EngineConfig, mesh: ParallelMesh, updater: Updater,
                 dp_runtime: DataParallelRuntime, pipeline: Pipeline, lr_scheduler: Any, ledger: CommLedger,
                 device: torch.device, compute_dtype: torch.dtype, monitor: TrainingMonitor,
                 sequence_check: Any = None, watchdog: Any = None):
        # Under a pipeline `module` is this rank's stage and train_batch is the only way to train (the schedule
        # interleaves the micro-batches' forwards and backwards); with tensor parallelism it holds TP slices.
        self.module = module
        self.mesh = mesh
        self.pipeline = pipeline
        self.config = config
        self.updater = updater
        self.optimizer = updater.optimizer
        self.dp_runtime = dp_runtime
        self.lr_scheduler = lr_scheduler
        self.ledger = ledger
        self.monitor = monitor
        """DeepSpeed's monitors, progress lines, timers, comms logger and flops profiler (`shardwise.telemetry`)."""
        self.dp_comm: Comm = mesh.comm(Axis.DP, ledger, name="dp")
        self.metrics_comm: Comm = mesh.comm(Axis.DP, ledger, name="dp:metrics")
        self.tp_comm: Comm = mesh.comm(Axis.TP, ledger, name="tp:metrics")
        self.device = device
        self.compute_dtype = compute_dtype
        self.sequence_check = sequence_check
        """`comm.sequence.SequenceCheck`: all ranks ran the same collectives, verified as each step opens."""
        self.watchdog = watchdog
        """`comm.watchdog.HangWatchdog`: the report of a collective that outlived communication.timeout_minutes."""
        self.skips = SkipGuard(config, mesh.global_rank)
        """Steps skipped for inf/nan: the backward seed, one line per skip, the end after too many in a row."""
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._activations = _ActivationMeter(list(module.parameters()), dp_runtime.param_storage_keys)
        self._last_activation_bytes = 0
        self._last_report_step = -1
        self._unpack_args = _forward_wants_unpacking(module)
        # The loader `initialize(training_data=...)` built (set there), and the iterator train_batch() reads when
        # given none: DeepSpeed's PipelineEngine loop `for step in ...: engine.train_batch()`.
        self.training_dataloader: Any = None
        self._data_iterator: Iterator[Any] | None = None
        self.ledger.begin_step(0)

    # -- identity -----------------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.dp_comm.rank

    @property
    def dp_size(self) -> int:
        return self.dp_comm.size

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def parameters(self):
        return self.module.parameters()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps - self._accum_origin + 1) % self.gradient_accumulation_steps() == 0

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        return self._step_applied

    @property
    def loss_scale(self) -> float:
        return self.updater.scaler.loss_scale

    # -- forward / backward / step ------------------------------------------------------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Call the model. A single tuple/list (dict) argument is unpacked into positional (keyword)
        arguments when the model's forward takes more than one parameter, so `engine(batch)` works
        for `model(input_ids, labels)` as well as for `model(batch)`."""
        self.pipeline.refuse_manual_step("engine(batch)")
        if len(inputs) == 1 and not kwargs and self._unpack_args:
            if isinstance(inputs[0], (tuple, list)):
                inputs = tuple(inputs[0])
            elif isinstance(inputs[0], dict):
                inputs, kwargs = (), dict(inputs[0])
        inputs = tuple(_to_device(x, self.device) for x in inputs)
        kwargs = {k: _to_device(v, self.device) for k, v in kwargs.items()}
        if not (self.module.training and torch.is_grad_enabled()):
            return self.module(*inputs, **kwargs)
        if (self.micro_steps - self._accum_origin) % self.gradient_accumulation_steps() == 0:
            self.open_step()
        self._activations.reset(list(self.module.parameters()))
        with torch.autograd.graph.saved_tensors_hooks(self._activations.pack, self._activations.unpack), \
                self.monitor.forward(self):
            out = self.module(*inputs, **kwargs)
        self._last_activation_bytes = self._activations.bytes
        return out

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        loss = loss_of(loss)       # a Hugging Face ModelOutput carries its loss
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise UserError("engine.backward(loss) needs a scalar loss tensor (the model must return the loss)")
        self.pipeline.refuse_manual_step("engine.backward(loss)")
        scaled = loss.float()
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            scaled = scaled / self.gradient_accumulation_steps()
        if self.updater.scaler.loss_scale != 1.0:
            scaled = scaled * self.updater.scaler.loss_scale
        # Inside no_sync() gradients accumulate locally, even on the boundary (DeepSpeed's rule).
        boundary = self.is_gradient_accumulation_boundary() and not self._inside_no_sync
        with self.monitor.timed(BACKWARD):
            self.dp_runtime.begin_backward(boundary)
            with self.monitor.timed(BACKWARD_INNER):
                scaled.backward(self.skips.seed(scaled, loss))
            with self.monitor.timed(BACKWARD_ALLREDUCE):
                self.dp_runtime.end_backward(boundary)
        self.monitor.observe_loss(loss)
        return loss

    def open_step(self) -> None:
        """A training step begins (its first micro-batch, or a pipeline's global batch): the ledger starts
        recording it, and the ranks check they ran the same collectives so far (`comm.sequence`)."""
        self.ledger.begin_step(self.global_steps)
        if self.sequence_check is not None:      # judged with the step's verdict (`_step`), or when the next opens
            self.sequence_check.launch(self.global_steps)

    def step(self) -> None:
        self._step(None)

    def step_agreeing_loss(self, loss_mean: torch.Tensor) -> float:
        """The boundary step of a global batch whose micro-batch losses average to `loss_mean` (a device scalar) on
        this rank: the loss is summed over data-parallel ranks in the step's own all-reduce when the groups match,
        and read with its one host read. Returns the mean over micro-batches and ranks, the same on every rank."""
        riders = Riders(loss_mean.detach().float().reshape(1), self.metrics_comm)
        self._step(riders)
        if riders.values is None:         # not a boundary (inside no_sync): agree on the loss by itself
            total = riders.tensor.to(torch.float64)
            self.metrics_comm.all_reduce(total)
            riders.values = total.tolist()
        return riders.values[0] / self.metrics_comm.size

    def _step(self, riders: Riders | None) -> None:
        self._refuse_inside_no_sync("engine.step()")
        if self.is_gradient_accumulation_boundary():
            check = self.sequence_check
            if check is not None and check.pending is not None:     # its result rides in the verdict's read
                if riders is None:
                    riders = Riders(check.pending.new_zeros(0, dtype=torch.float32), self.metrics_comm)
                riders.carry = check.pending
            with self.monitor.timed(STEP):
                applied = self.updater.step(riders)
                if riders is not None and riders.carry is not None:
                    self._settle_check(riders)
                self._step_applied = applied
                if applied:
                    if self.lr_scheduler is not None:
                        self.lr_scheduler.step()
                else:
                    self.skipped_steps += 1
                self.dp_runtime.zero_grad()
                self.updater.zero_master_grads()
            self.global_steps += 1
            self.global_samples += self.config.batch.train_batch_size
            self._last_report_step = self.global_steps - 1
            self.monitor.after_step(self)
            self.micro_steps += 1
            self.skips.after_step(self._step_applied, step=self.global_steps - 1, lr=self.get_lr()[0],
                                  loss_scale=self.loss_scale)
            return
        self.micro_steps += 1

    def _settle_check(self, riders: Riders) -> None:
        """Judge the desync check from the values that rode after the riders' own sums (or read it alone)."""
        ours = riders.tensor.numel()
        values, riders.values = riders.values, (riders.values[:ours] if riders.values is not None else None)
        self.sequence_check.settle(values[ours:] if values is not None else None)

    def complete_global_batch(self, *, micro_batches: int, activation_bytes: int) -> None:
        """For a `Pipeline` that ran a whole global batch's forwards and backwards itself (a schedule): count its
        micro-batches, take the step, and keep the activation figure its meter measured."""
        self.micro_steps += micro_batches - 1
        self.step()
        self._last_activation_bytes = activation_bytes

    def zero_grad(self) -> None:
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
        with self.monitor.global_batch(self) as result:
            result.loss = self.pipeline.train_batch(self, data_iter)
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
            loss = self.pipeline.eval_batch(self, data_iter, count)
        finally:
            self.module.train(was_training)
        self.monitor.eval_loss(self, loss)
        return _loss_value(loss)

    # -- reports ------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes held by this rank: model parameters, gradient buffers, optimizer states (fp32 masters
        included), activations saved by the last forward, offload's pinned host staging buffers
        (`host_staging`, outside the model states), and the process's peak RSS."""
        report = {
            "params": self.updater.param_bytes(),
            "grads": self.dp_runtime.grad_bytes,
            "optimizer": self.updater.state_bytes(),
            "activations": self._last_activation_bytes,
        }
        report["model_states"] = report["params"] + report["grads"] + report["optimizer"]
        report["host_staging"] = self.updater.staging_bytes()
        report["peak_rss"] = _peak_rss_bytes()
        if self.device.type == "cuda":
            report["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return report

    def comm_report(self, step: int | None = None) -> list[dict[str, Any]]:
        """The collectives of the last completed step (or `step`): op, group, group_size, dtype, count,
        bytes, seconds."""
        return self.ledger.report(self._last_report_step if step is None else step)

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> bool:
        """Collective: every rank calls it. DeepSpeed's layout, per model-parallel rank (`engine_checkpoint`).
        With save_latest=False the tag is written but `latest` keeps naming the tag it named."""
        return engine_checkpoint.save(self, save_dir, tag, client_state, save_latest=save_latest)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """Returns (checkpoint path, client_state), or (None, None) when `load_dir` holds no checkpoint."""
        return engine_checkpoint.load(self, load_dir, tag, strict=load_module_strict,
                                      load_optimizer_states=load_optimizer_states,
                                      load_lr_scheduler_states=load_lr_scheduler_states,
                                      load_module_only=load_module_only)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The whole model's weights (ZeRO-3 shards, TP slices and pipeline stages assembled) in the training
        dtype, as one `torch.save`d state dict under the single-process names, written by rank 0. Collective.
        Unlike DeepSpeed, ZeRO-3 does not need stage3_gather_16bit_weights_on_model_save for it."""
        return engine_checkpoint.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.dp_runtime.close()
        self.pipeline.close()
        self.monitor.close()


def _loss_value(value: float) -> torch.Tensor:
    """A step's reported loss as DeepSpeed hands it back: a 0-dim tensor (float64 on the CPU: exactly the mean the
    ranks agreed on; no device sync is left to the caller)."""
    return torch.tensor(value, dtype=torch.float64)


def repeating(loader: Any) -> Iterator[Any]:
    """DeepSpeed's RepeatingLoader: the batches of ``loader``, started over at its end with the next epoch of its
    sampler (a DistributedSampler reshuffles per epoch)."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise UserError("the training data gives no batch on this rank: it needs at least micro_batch x "
                            "data-parallel ranks samples (the loader drops an incomplete last batch)")
        epoch += 1


def _forward_wants_unpacking(module: torch.nn.Module) -> bool:
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return False
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return len(positional) > 1 or any(p.kind is p.VAR_POSITIONAL for p in positional)


def _to_device(x: Any, device: torch.device) -> Any:
    if torch.is_tensor(x) and x.device != device:
        return x.to(device, non_blocking=True)
    return x


def _peak_rss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
