"""`DistributedDataParallel`: torch DDP's wrapper on shardwise's bucketed, overlapped all-reduce.

    model = DistributedDataParallel(model, bucket_cap_mb=25)        # all_reduce="auto" | "backend" | "ring" | "shm"
    optimizer = torch.optim.AdamW(model.parameters())
    loss = model(ids, labels); loss.backward(); optimizer.step(); optimizer.zero_grad()

The runtime is the engine's stage-0 `BucketedAllReduce`; `_LoopReducer` adds what a plain loop lacks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from shardwise.comm.ledger import CommLedger
from shardwise.config import AllReduceImpl
from shardwise.errors import UserError
from shardwise.parallel.data_parallel import BucketedAllReduce
from shardwise.parallel.wrappers.comm_hooks import CommHook, HookBucket, check_hook, future_handle
from shardwise.parallel.wrappers.module import clip_sharded_
from shardwise.parallel.wrappers.policies import groups_of
from shardwise.parallel.wrappers.steps import StepClock

MIB = 1 << 20


class NothingToTrain(UserError, RuntimeError):
    """A module with no parameter that requires grad: torch's DDP raises a RuntimeError for it, which callers
    catch; this is that and shardwise's one-line UserError at once."""


class UnusedParameters(UserError, RuntimeError):
    """Without `find_unused_parameters=True`, a synchronizing backward left some parameter without a gradient:
    raised at the next forward, as torch DDP raises its RuntimeError there."""


@dataclass(frozen=True)
class _Settings:
    """The constructor's choices a pickled wrapper is rebuilt with."""

    bucket_cap_mb: float
    impl: AllReduceImpl
    find_unused: bool


class DistributedDataParallel(nn.Module):
    """torch DDP's behaviour: every rank starts from rank 0's parameters and buffers; gradients are averaged over
    the dp group during backward (bucketed, overlapped); `no_sync()` skips communication for accumulation.
    torch's `device_ids`, `output_device`, `dim` and `gradient_as_bucket_view` are accepted: gradients are always
    bucket views. As torch DDP, a synchronizing backward that leaves a parameter without a gradient is an error
    unless `find_unused_parameters=True`: the next forward raises `UnusedParameters` (a RuntimeError) naming the
    parameters (the backward itself still completes, its missing slots summed as zeros, so no rank is left waiting
    in a collective). With `find_unused_parameters=True` a parameter that no rank used since the last
    synchronizing step is left as it was: a .grad that was None (after `optimizer.zero_grad()`) stays None, so the
    optimizer neither decays nor moves it on momentum (one more all-reduce per synchronizing step, of a flag per
    parameter).

    `all_reduce`: "auto" (default) sums CPU gradients through shared memory when every rank of the group shares
    this host's /dev/shm with room for the buckets (`comm/shm.py`; cheaper than gloo's sockets), else calls the
    process group's all_reduce (always on GPUs: NCCL); "backend", "ring" and "shm" choose one."""

    def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group: Any = None, bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = True, *,
                 device_mesh: Any = None, all_reduce: str = "auto"):
        super().__init__()
        self._auto = all_reduce == "auto"
        try:
            impl = AllReduceImpl(all_reduce)
        except ValueError:
            raise UserError(f"all_reduce = {all_reduce!r}: give 'auto' (the default), 'backend' (the process "
                            f"group's all_reduce), 'ring' (shardwise's ring) or 'shm' (shardwise's shared-memory "
                            f"all-reduce: CPU, one host)") from None
        if not bucket_cap_mb > 0:
            raise UserError(f"bucket_cap_mb = {bucket_cap_mb}: give a positive size in MiB, e.g. 25")
        if device_ids and torch.cuda.is_available():
            torch.cuda.set_device(device_ids[0])
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.require_sync = True
        # what a pickled wrapper is rebuilt from (`__setstate__`)
        self._settings = _Settings(bucket_cap_mb, impl, find_unused_parameters)
        self._build(device_mesh if device_mesh is not None else process_group, broadcast=True)

    def _build(self, mesh: Any, *, broadcast: bool) -> None:
        """The communication state: ledger, groups, the reducer and its hooks on the parameters."""
        self.ledger = CommLedger()
        self.clock = StepClock(self.ledger)      # steps for comm_report(); the broadcasts below fall in step -1
        self.groups = groups_of(mesh, ledger=self.ledger)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            raise NothingToTrain("DistributedDataParallel: the module has no parameter that requires grad; give "
                                 "it a model with trainable parameters")
        if broadcast:
            with torch.no_grad():           # identical start, as torch DDP: rank 0's values everywhere
                self.groups.dp.broadcast_coalesced([*self.module.parameters(), *self.module.buffers()])
        numel = int(self._settings.bucket_cap_mb * MIB) // params[0].element_size()
        # prescale: each gradient is divided by the dp size before the sum (torch DDP's arithmetic), by its hook as
        # it is final, so the division overlaps backward and the launch waits for none
        self.reducer = _LoopReducer(params, self.groups.dp, bucket_numel=max(numel, 1),
                                    impl=self._settings.impl, prescale=True)
        if self._settings.find_unused:
            self.reducer.track_unused(params)
        self._param_names = {id(p): n for n, p in self.module.named_parameters()}

    def __getstate__(self) -> dict[str, Any]:
        """`torch.save(model)` pickles the module and the settings; the process group, the buckets (maybe in
        shared memory) and the hooks are rebuilt on load, as torch DDP does, over the default group."""
        state = self.__dict__.copy()
        for name in ("ledger", "clock", "groups", "reducer", "_param_names"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.require_sync = True
        self._build(None, broadcast=False)       # the weights are the pickled ones: nothing to broadcast

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self._refuse_unfinished()
            self.clock.forward_started(self.require_sync)
            self.reducer.begin_backward(self.require_sync)
            self.reducer.note_missing_grads()
            # .grads the optimizer set to None: the hooks write their slots (divided) as backward hands them over
            self.reducer.reclaim_grads()
            if self.broadcast_buffers and self.require_sync:
                with torch.no_grad():
                    self.groups.dp.broadcast_coalesced(list(self.module.buffers()))
        return self.module(*args, **kwargs)

    def _refuse_unfinished(self) -> None:
        """torch DDP's check at a forward: the last synchronizing backward reduced every parameter."""
        missing, self.reducer.missing = self.reducer.missing, []
        if missing:
            names = [self._param_names.get(id(p), "?") for p in missing]
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            raise UnusedParameters(f"DistributedDataParallel: the last backward gave no gradient to "
                                   f"{', '.join(names[:4])}{more} (not used to compute the loss); pass "
                                   f"find_unused_parameters=True, or use every parameter in each forward")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards (and their backwards) inside accumulate gradients locally; the next backward outside
        all-reduces the sum."""
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """torch DDP's communication hook: `hook(state, bucket)` is called as each bucket is ready, in place of the
        all-reduce, and returns a `torch.futures.Future` of the bucket's new gradients (averaging is the hook's
        job). torch's hooks run unchanged (fp16 compression; bf16 and PowerSGD need NCCL); see `comm_hooks.py`."""
        # under 'auto' the hook replaces whichever all-reduce was chosen (the buckets may live in shared memory)
        name = check_hook(hook, registered=self.reducer.comm_hook is not None,
                          impl=AllReduceImpl.BACKEND if self._auto else self.reducer.impl)
        self.reducer.comm_hook = (state, hook, name)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's clip_grad_norm_ on the replicas (equal on every rank); over TP slices when the mesh has TP."""
        if float(norm_type) != 2.0:
            raise UserError(f"clip_grad_norm_: norm_type = {norm_type}; only the 2-norm is supported")
        return clip_sharded_(list(self.module.parameters()), max_norm, self.groups, dp_sharded=False)

    def comm_report(self, step: int | None = None) -> list[dict[str, Any]]:
        """The collectives of the last complete training step (or `step`, from 0), in the engine's rows: one
        all-reduce per bucket in a synchronizing step."""
        return self.clock.report(step)

    def close(self) -> None:
        """Remove the hooks (the module keeps its parameters and gradients)."""
        self.reducer.close()


class _LoopReducer(BucketedAllReduce):
    """The engine's reducer (each `.grad` views a slot of a flat bucket [numel_k]; buckets fill in reverse
    registration order and launch from post-accumulate-grad hooks in index order while backward runs) plus what a
    plain loop lacks, the engine's calls around backward: the wrapper's forward arms the buckets (off inside
    `no_sync()`), and the first gradient of a communicating backward queues autograd's final callback, which waits
    for every bucket (each divided by the dp size as it launched, as torch DDP divides). One Python hook per
    parameter (the reducer's)."""

    _callback_queued = False
    comm_hook: tuple[Any, CommHook, str] | None = None     # (state, hook, its name): register_comm_hook's
    # find_unused_parameters: the parameters, their index, which got a gradient on this rank since the last
    # synchronizing backward, and which had .grad None at the last forward
    _tracked: list[torch.nn.Parameter] = []
    _index: dict[int, int] = {}
    _used: bytearray | None = None
    _was_none: list[bool] = []

    _boundary = True
    missing: list[torch.nn.Parameter] = []
    """Without find_unused_parameters: the parameters the last synchronizing backward gave no gradient."""

    def begin_backward(self, boundary: bool) -> None:
        super().begin_backward(boundary)
        self._boundary = boundary

    def track_unused(self, params: list[torch.nn.Parameter]) -> None:
        """torch DDP's find_unused_parameters: leave the .grad of a parameter no rank used as it was."""
        self._tracked = list(params)
        self._index = {id(p): k for k, p in enumerate(params)}
        self._used = bytearray(len(params))
        self._was_none = [False] * len(params)

    def note_missing_grads(self) -> None:
        """At each forward with grad, before `reclaim_grads` gives every .grad its slot: which were None."""
        if self._used is not None:
            self._was_none = [p.grad is None for p in self._tracked]

    def _settle_unused(self) -> None:
        """After a synchronizing backward: one all-reduce of the used flags [n_params]; a parameter no rank used
        whose .grad was None at the forward gets None back (its slot holds zeros, summed from every rank)."""
        assert self._used is not None
        used = torch.frombuffer(self._used, dtype=torch.uint8).to(self.buckets[0].buffer.device, torch.int32)
        self.comm.all_reduce(used)
        for k, count in enumerate(used.tolist()):
            if count == 0 and self._was_none[k]:
                self._tracked[k].grad = None
        self._used = bytearray(len(self._tracked))

    def _hooks_divide(self) -> bool:
        return self.comm_hook is None and super()._hooks_divide()     # a comm hook does its own averaging

    def _launch(self, bucket) -> None:
        if self.comm_hook is None:
            super()._launch(bucket)
            return
        self.settle_fresh(bucket)
        state, hook, name = self.comm_hook
        future = hook(state, HookBucket(bucket, last=bucket.index == len(self.buckets) - 1))
        bucket.handle = future_handle(future, bucket.buffer, name)

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        super()._on_grad_ready(p)
        if self._used is not None:
            self._used[self._index[id(p)]] = 1
        # find_unused_parameters settles after every synchronizing backward, on one rank too
        settles = self.enabled or (self._used is not None and self._boundary)
        if settles and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._callback_queued = False
        if self._used is None and self.enabled:
            self.missing = [p for b in self.buckets for p in b.params if id(p) not in b.ready]
        self.finish()
        if self._used is not None:
            self._settle_unused()
