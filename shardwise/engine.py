"""The training engine: DeepSpeed's API over strategy objects chosen once at build time.

    loss = engine(batch)      # calls the model (tracks the activations it saves for backward)
    engine.backward(loss)     # loss / gradient_accumulation_steps (* fp16 loss scale); syncs grads on the boundary
    engine.step()             # on the boundary: optimizer step (unscale, overflow skip, clip), lr step, zero grads

The engine holds no `if stage == ...` ladders: `grad_sync` (how gradients are combined across data-parallel
ranks) and `optimizer_step` (how the update is applied) are picked by `shardwise.initialize`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator

import torch

from shardwise import engine_checkpoint
from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.errors import UserError


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


class Engine:
    """Built by `shardwise.initialize`; see the module docstring for the training loop."""

    def __init__(self, *, module: torch.nn.Module, config: Any, optimizer_step: Any, grad_sync: Any,
                 lr_scheduler: Any, dp_comm: Comm, metrics_comm: Comm, ledger: CommLedger,
                 device: torch.device, compute_dtype: torch.dtype, pipeline: Any = None,
                 tp_comm: Comm | None = None):
        self.module = module
        # Tensor parallelism: this rank's TP group (None without TP). Checkpoints are per TP rank, and their
        # barrier / failure agreement spans dp then tp, i.e. the whole (dp, tp) mesh.
        self.tp_comm = tp_comm
        # Pipeline parallelism (`parallel.pipeline.apply.PipelineTrainer`): `module` is this rank's stage and
        # train_batch is the only way to train (the schedule interleaves the micro-batches' forwards/backwards).
        self.pipeline = pipeline
        self.config = config
        self.optimizer_step = optimizer_step
        self.optimizer = optimizer_step.optimizer
        self.grad_sync = grad_sync
        self.lr_scheduler = lr_scheduler
        self.dp_comm = dp_comm
        self.metrics_comm = metrics_comm
        self.ledger = ledger
        self.device = device
        self.compute_dtype = compute_dtype
        self.gradient_accumulation_steps = config.batch.grad_accum
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._activations = _ActivationMeter(list(module.parameters()), grad_sync.param_storage_keys)
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
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        return self._step_applied

    @property
    def loss_scale(self) -> float:
        return self.optimizer_step.scaler.loss_scale

    # -- forward / backward / step ------------------------------------------------------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Call the model. A single tuple/list (dict) argument is unpacked into positional (keyword)
        arguments when the model's forward takes more than one parameter, so `engine(batch)` works
        for `model(input_ids, labels)` as well as for `model(batch)`."""
        self._refuse_under_pipeline("engine(batch)")
        if len(inputs) == 1 and not kwargs and self._unpack_args:
            if isinstance(inputs[0], (tuple, list)):
                inputs = tuple(inputs[0])
            elif isinstance(inputs[0], dict):
                inputs, kwargs = (), dict(inputs[0])
        inputs = tuple(_to_device(x, self.device) for x in inputs)
        kwargs = {k: _to_device(v, self.device) for k, v in kwargs.items()}
        if not (self.module.training and torch.is_grad_enabled()):
            return self.module(*inputs, **kwargs)
        if self.micro_steps % self.gradient_accumulation_steps == 0:
            self.ledger.begin_step(self.global_steps)
        self._activations.reset(list(self.module.parameters()))
        with torch.autograd.graph.saved_tensors_hooks(self._activations.pack, self._activations.unpack):
            out = self.module(*inputs, **kwargs)
        self._last_activation_bytes = self._activations.bytes
        return out

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise UserError("engine.backward(loss) needs a scalar loss tensor (the model must return the loss)")
        self._refuse_under_pipeline("engine.backward(loss)")
        scaled = loss.float()
        if scale_wrt_gas and self.gradient_accumulation_steps > 1:
            scaled = scaled / self.gradient_accumulation_steps
        if self.optimizer_step.scaler.loss_scale != 1.0:
            scaled = scaled * self.optimizer_step.scaler.loss_scale
        boundary = self.is_gradient_accumulation_boundary()
        self.grad_sync.begin_backward(boundary)
        scaled.backward()
        self.grad_sync.end_backward(boundary)
        return loss

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            applied = self.optimizer_step.step()
            self._step_applied = applied
            if applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            else:
                self.skipped_steps += 1
            self.grad_sync.zero_grad()
            self.optimizer_step.zero_master_grads()
            self.global_steps += 1
            self.global_samples += self.config.batch.train_batch_size
            self._last_report_step = self.global_steps - 1
        self.micro_steps += 1

    def zero_grad(self) -> None:
        self.grad_sync.zero_grad()

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
        if self.pipeline is not None:
            return _loss_value(self.pipeline.train_batch(self, data_iter))
        if data_iter is None:
            raise UserError("engine.train_batch(data_iter) needs an iterator of micro-batches: pass one, or give "
                            "shardwise.initialize(training_data=...) or engine.set_dataiterator(...)")
        total = torch.zeros((), dtype=torch.float32)
        for _ in range(self.gradient_accumulation_steps):
            loss = self(next(data_iter))
            self.backward(loss)
            self.step()
            total += loss.detach().float().cpu()
        return self._dp_mean(total, self.gradient_accumulation_steps)

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any], num_micro_batches: int | None = None) -> torch.Tensor:
        """The mean loss of `num_micro_batches` (default gradient_accumulation_steps) micro-batches from
        `data_iter`, in eval mode and without gradients, averaged over data-parallel ranks; the same number on
        every rank (DeepSpeed's PipelineEngine.eval_batch, also without a pipeline). Gradients, optimizer and
        step counters are untouched; the module's train/eval mode is restored. Collective."""
        count = self.gradient_accumulation_steps if num_micro_batches is None else num_micro_batches
        if count < 1:
            raise UserError(f"engine.eval_batch: num_micro_batches = {count}; it must be >= 1")
        if self.pipeline is None and data_iter is None:
            raise UserError("engine.eval_batch(data_iter) needs an iterator of micro-batches")
        was_training = self.module.training
        self.module.eval()
        try:
            if self.pipeline is not None:
                return _loss_value(self.pipeline.eval_batch(self, data_iter, count))
            total = torch.zeros((), dtype=torch.float32)
            for _ in range(count):
                loss = self(next(data_iter))
                if not torch.is_tensor(loss) or loss.dim() != 0:
                    raise UserError("engine.eval_batch needs the model to return a scalar loss tensor")
                total += loss.float().cpu()
        finally:
            self.module.train(was_training)
        return self._dp_mean(total, count)

    def _dp_mean(self, total: torch.Tensor, count: int) -> torch.Tensor:
        """``total`` (the sum of this rank's ``count`` micro-batch losses) as the mean over micro-batches and
        data-parallel ranks: one all-reduce; the same value on every rank."""
        total /= count
        self.metrics_comm.all_reduce(total)
        return _loss_value(float(total) / self.dp_size)

    # -- reports ------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes held by this rank: model parameters, gradient buffers, optimizer states (fp32 masters
        included), activations saved by the last forward, and the process's peak RSS."""
        report = {
            "params": self.optimizer_step.param_bytes(),
            "grads": self.grad_sync.grad_bytes,
            "optimizer": self.optimizer_step.state_bytes(),
            "activations": self._last_activation_bytes,
        }
        report["model_states"] = report["params"] + report["grads"] + report["optimizer"]
        report["peak_rss"] = _peak_rss_bytes()
        if self.device.type == "cuda":
            report["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return report

    def comm_report(self, step: int | None = None) -> list[dict[str, Any]]:
        """The collectives of the last completed step (or `step`): op, group, group_size, dtype, count,
        bytes, seconds."""
        step = self._last_report_step if step is None else step
        return [{"op": s.op, "group": s.group, "group_size": s.group_size, "dtype": s.dtype,
                 "count": s.count, "bytes": s.nbytes, "seconds": s.duration_s}
                for s in self.ledger.summary(step)]

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> bool:
        """Collective: every rank calls it. DeepSpeed's layout, per model-parallel rank (`engine_checkpoint`)."""
        return engine_checkpoint.save(self, save_dir, tag, client_state)

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

    def _refuse_under_pipeline(self, what: str) -> None:
        if self.pipeline is not None:
            raise UserError(f"{what} is not available with pipeline.stages = {self.pipeline.stage.num_stages}: "
                            f"train with engine.train_batch(data_iter)")

    def close(self) -> None:
        self.grad_sync.close()
        if self.pipeline is not None:
            self.pipeline.runtime.close()


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
