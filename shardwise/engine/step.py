"""The step driver: counts micro-batches and optimizer steps and takes the update on each accumulation boundary.

The engine's `forward` / `backward` / `step` and every `BatchSchedule` (the plain micro-batch loop, a pipeline
schedule) go through `TrainingSteps`, the `StepDriver` of `parallel/interfaces.py`.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.comm.sequence import SequenceCheck
from shardwise.config.batch import BatchSizes
from shardwise.engine.skips import SkipGuard
from shardwise.errors import NoSyncError, UserError
from shardwise.parallel.context.interface import BatchPart, WholeBatch
from shardwise.parallel.grad_norm import ExtraSums
from shardwise.parallel.interfaces import DataParallelRuntime, Updater
from shardwise.parallel.outputs import loss_of
from shardwise.telemetry.activations import SavedTensorMeter
from shardwise.telemetry.monitor import TrainingMonitor
from shardwise.telemetry.timers import BACKWARD, BACKWARD_ALLREDUCE, BACKWARD_INNER, STEP


class TrainingSteps:
    """The step counters and the calls that move them. DeepSpeed's names: `global_steps` (optimizer steps taken,
    skipped ones included), `global_samples`, `micro_steps` (micro-batches stepped), `skipped_steps`.

        forward(batch)                   the model's forward; the first micro-batch of a global batch opens the step
        backward(loss)                   loss / micro-batches (* fp16 loss scale), the dp runtime around it
        step()                           a micro-batch counted; on the boundary the update, the lr step, zeroed grads
        open_step / complete_global_batch   around a schedule that runs a whole global batch itself
    """

    def __init__(self, *, module: torch.nn.Module, batch: BatchSizes, updater: Updater,
                 dp_runtime: DataParallelRuntime, lr_scheduler: Any, ledger: CommLedger, monitor: TrainingMonitor,
                 metrics_comm: Comm, device: torch.device, skips: SkipGuard,
                 sequence_check: SequenceCheck | None = None, batch_part: BatchPart | None = None):
        self.module = module
        self.batch = batch
        """The batch sizes in force (`set_train_batch_size` replaces them between global batches)."""
        self.updater = updater
        self._dp_runtime = dp_runtime
        self.lr_scheduler = lr_scheduler
        self.ledger = ledger
        self.monitor = monitor
        self.metrics_comm = metrics_comm
        """The dp group, for the loss average ("dp:metrics")."""
        self.device = device
        self.skips = skips
        self.sequence_check = sequence_check
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.step_applied = False
        self.overflow = False
        """Whether the latest update (an accumulation boundary) was skipped on inf/nan gradients: DeepSpeed's
        `engine.optimizer.overflow`, unchanged by the micro-batches between boundaries."""
        # The micro-step count at which the current accumulation cycle started: moved when the batch sizes change
        # or a checkpoint is loaded, so a new accumulation count starts a fresh cycle instead of inheriting the old
        # count's phase.
        self.accum_origin = 0
        self.boundary_override: bool | None = None
        """Set by `set_gradient_accumulation_boundary`: whether the current micro-batch ends the global batch,
        in place of counting micro-batches (None: counted)."""
        self._step_open = False     # a training forward opened the step and no update closed it yet
        self.inside_no_sync = False
        """Inside `engine.no_sync()`: gradients accumulate locally, even on the boundary (DeepSpeed's rule)."""
        self.last_report_step = -1
        self.activation_bytes = 0
        """Bytes autograd saved for backward in the last training forward (or a schedule's measured peak)."""
        self._meter = SavedTensorMeter(dp_runtime.param_storage_keys)
        self._unpacking = BatchUnpacking.of(module)
        self._batch_part: BatchPart = batch_part or WholeBatch()
        """This rank's part of a micro-batch every context-parallel rank was given whole (the whole of it without
        context parallelism)."""
        ledger.begin_step(0)

    # -- what schedules read --------------------------------------------------------------------------
    @property
    def micro_batches(self) -> int:
        return self.batch.grad_accum

    @property
    def loss_scale(self) -> float:
        return self.updater.scaler.loss_scale

    @property
    def dp_runtime(self) -> DataParallelRuntime:
        return self._dp_runtime

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.updater.optimizer

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.updater.optimizer.param_groups]

    def is_gradient_accumulation_boundary(self) -> bool:
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps - self.accum_origin + 1) % self.micro_batches == 0

    def at_global_batch_start(self) -> bool:
        if self.boundary_override is not None:   # the caller ends global batches: one is open until its update
            return not self._step_open
        return (self.micro_steps - self.accum_origin) % self.micro_batches == 0

    # -- a micro-batch ----------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Call the model. A single batch argument is unpacked when the model's forward takes more than one
        parameter (`BatchUnpacking`), so `engine(batch)` works for `model(input_ids, labels)`, for a Hugging Face
        model given an `(input_ids, labels)` pair or a dict, and for `model(batch)`."""
        if len(inputs) == 1 and not kwargs:
            inputs, kwargs = self._unpacking.split(inputs[0])
        inputs = tuple(_to_device(x, self.device) for x in inputs)
        kwargs = {k: _to_device(v, self.device) for k, v in kwargs.items()}
        inputs, kwargs = self._batch_part.local_batch(inputs, kwargs)
        # Grad mode, not the module's train/eval mode, decides whether this forward is part of a step: a model
        # left in eval mode (as `from_pretrained` returns it) still trains when grad is on, and DeepSpeed's
        # engine counts and steps it alike. A forward at a global batch's start opens a step even when the last one
        # had no update (a backward without step): its desync check is what tells the ranks apart then.
        if not torch.is_grad_enabled():
            return self.module(*inputs, **kwargs)
        if self.at_global_batch_start():
            self.open_step()
        with self._meter.measuring(list(self.module.parameters())), self.monitor.forward(self):
            out = self.module(*inputs, **kwargs)
        self.activation_bytes = self._meter.bytes
        return out

    def local_micro_batch(self, batch: Any) -> Any:
        """This rank's part of a pipeline micro-batch (inputs, labels), each item as `forward` takes its arguments'
        part (`BatchPart`)."""
        if not isinstance(batch, (tuple, list)):
            return batch
        parts, _ = self._batch_part.local_batch(tuple(batch), {})
        return list(parts) if isinstance(batch, list) else parts

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        loss = loss_of(loss)       # a Hugging Face ModelOutput carries its loss
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise UserError("engine.backward(loss) needs a scalar loss tensor (the model must return the loss)")
        scaled = loss.float()
        if scale_wrt_gas and self.micro_batches > 1:
            scaled = scaled / self.micro_batches
        if self.loss_scale != 1.0:
            scaled = scaled * self.loss_scale
        boundary = self.is_gradient_accumulation_boundary() and not self.inside_no_sync
        with self.monitor.timed(BACKWARD):
            self._dp_runtime.begin_backward(boundary)
            with self.monitor.timed(BACKWARD_INNER):
                scaled.backward(self.skips.seed(scaled, loss))
            with self.monitor.timed(BACKWARD_ALLREDUCE):
                self._dp_runtime.end_backward(boundary)
        self.monitor.observe_loss(loss)
        return loss

    def backward_seed(self, scaled: torch.Tensor, loss: torch.Tensor) -> torch.Tensor | None:
        """What a schedule's loss backward starts from (`SkipGuard.seed`, as `backward`'s own)."""
        return self.skips.seed(scaled, loss)

    # -- the step -----------------------------------------------------------------------------------------
    def open_step(self) -> None:
        """A training step begins (its first micro-batch, or a pipeline's global batch): the ledger starts
        recording it, and the ranks check they ran the same collectives so far (`comm.sequence`). The check's
        all-reduce runs on the host, beside the step; it is judged before the step's first collective."""
        self._step_open = True
        self.ledger.begin_step(self.global_steps)
        if self.sequence_check is not None:      # judged before this rank's next collective, or the update
            self.sequence_check.launch(self.global_steps)

    def step(self) -> None:
        self._step(None)

    def step_agreeing_loss(self, loss_mean: torch.Tensor) -> float:
        """The boundary step of a global batch whose micro-batch losses average to `loss_mean` (a device scalar) on
        this rank: the loss is summed over data-parallel ranks in the step's own all-reduce when the groups match,
        and read with its one host read. Returns the mean over micro-batches and ranks, the same on every rank."""
        extra = ExtraSums(loss_mean.detach().float().reshape(1), self.metrics_comm)
        self._step(extra)
        if extra.values is None:         # not a boundary (inside no_sync): agree on the loss by itself
            total = extra.tensor.to(torch.float64)
            self.metrics_comm.all_reduce(total)
            extra.values = total.tolist()
        return extra.values[0] / self.metrics_comm.size

    def _step(self, extra: ExtraSums | None) -> None:
        if self.inside_no_sync:
            raise NoSyncError("engine.step() inside engine.no_sync() (It is illegal to call Engine.step() inside "
                              "no_sync context manager): leave the no_sync block before stepping")
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            self.step_applied = False       # DeepSpeed's was_step_applied: whether the latest step() updated
            return
        if self.sequence_check is not None:     # judged before the update at the latest (a host all-reduce)
            self.sequence_check.settle()
        with self.monitor.timed(STEP):
            applied = self.updater.step(extra)
            self.step_applied = applied
            self.overflow = not applied
            if applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            else:
                self.skipped_steps += 1
            self._dp_runtime.zero_grad()
            self.updater.zero_master_grads()
        self.global_steps += 1
        self._step_open = False
        self.global_samples += self.batch.train_batch_size
        self.last_report_step = self.global_steps - 1
        self.monitor.after_step(self)
        self.micro_steps += 1
        self.skips.after_step(applied, step=self.global_steps - 1, lr=self.get_lr()[0], loss_scale=self.loss_scale)

    def stage_forwards(self) -> ContextManager[Callable[[int], Any] | None]:
        return self.monitor.stage_forwards(self)

    def complete_global_batch(self, *, micro_batches: int, activation_bytes: int) -> None:
        """For a schedule that ran a whole global batch's forwards and backwards itself: count its micro-batches,
        take the step, and keep the activation figure its meter measured."""
        self.micro_steps += micro_batches - 1
        self.step()
        self.activation_bytes = activation_bytes

    # -- batch sizes and resuming -------------------------------------------------------------------------
    def restart_cycle(self, batch: BatchSizes | None = None) -> None:
        """Start a fresh accumulation cycle here (between global batches), with new batch sizes if given."""
        if batch is not None:
            self.batch = batch
        self.accum_origin = self.micro_steps
        self._step_open = False

    def resume(self, *, global_steps: int, global_samples: int, skipped_steps: int) -> None:
        """The counters a checkpoint saved. `micro_steps` is derived, not restored (as DeepSpeed): another
        gradient_accumulation_steps or dp size then starts its accumulation cycle at the step boundary instead of
        inheriting the writer's phase."""
        self.global_steps = global_steps
        self.global_samples = global_samples
        self.skipped_steps = skipped_steps
        self.micro_steps = global_steps * self.micro_batches
        self.restart_cycle()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.inside_no_sync:
            raise NoSyncError("engine.no_sync() is already active: no_sync context manager reentry is unsupported")
        self.inside_no_sync = True
        try:
            yield
        finally:
            self.inside_no_sync = False


@dataclass(frozen=True)
class BatchUnpacking:
    """How `engine(batch)` with one batch argument calls a model whose forward takes several parameters.

    A dict becomes keyword arguments. A tuple or list becomes positional arguments, except that its last item is
    passed as ``labels=`` when the forward has a ``labels`` parameter that the positions do not reach: a Hugging
    Face model's forward is ``(input_ids, attention_mask, ...)`` or ``(input_ids, past_key_values, ...)`` and takes
    ``labels`` far down, and an ``(inputs, labels)`` pair (DeepSpeed's batch shape, also its pipeline's) must not
    land labels on the attention mask. Such a pair maps to ``model(inputs, labels=labels)``; a longer tuple is
    refused (its middle items have no safe place), with the fix. A model with a single parameter gets the batch
    as it is."""

    unpack: bool
    labels_position: int | None
    """The index of ``labels`` among the forward's positional parameters; -1 when it is keyword-only; None when
    the forward has no ``labels`` parameter."""
    parameters: tuple[str, ...]

    @classmethod
    def of(cls, module: torch.nn.Module) -> "BatchUnpacking":
        try:
            sig = inspect.signature(module.forward)
        except (TypeError, ValueError):
            return cls(False, None, ())
        positional = [p for p in sig.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
        names = [p.name for p in positional]
        labels = sig.parameters.get("labels")
        position = None if labels is None else names.index("labels") if "labels" in names else -1
        unpack = len(positional) > 1 or any(p.kind is p.VAR_POSITIONAL for p in positional)
        return cls(unpack, position, tuple(names))

    def split(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(positional, keyword) arguments for the model's forward from one batch argument."""
        if not self.unpack:
            return (batch,), {}
        if isinstance(batch, dict):
            return (), dict(batch)
        if not isinstance(batch, (tuple, list)):
            return (batch,), {}
        items = tuple(batch)
        if self.labels_position is None or len(items) < 2 or 0 <= self.labels_position < len(items):
            return items, {}        # no labels parameter, or the positions reach it: the tuple means them
        if len(items) == 2:
            return items[:1], {"labels": items[1]}
        landing = self.parameters[len(items) - 1] if len(items) <= len(self.parameters) else "*args"
        raise UserError(f"engine(batch) with a {len(items)}-item {type(batch).__name__}: the model's forward takes "
                        f"({', '.join(self.parameters[:3])}, ...) and labels by name, so the last item would become "
                        f"{landing!r}; pass keywords (engine(input_ids=..., attention_mask=..., labels=...)) or a "
                        f"dict batch")


def _to_device(x: Any, device: torch.device) -> Any:
    if torch.is_tensor(x) and x.device != device:
        return x.to(device, non_blocking=True)
    return x
