"""Data parallelism: bucketed gradient all-reduce, launched from backward hooks as buckets fill.

Every parameter's `.grad` is a view into a flat bucket buffer, so autograd accumulates straight into the
buffer that is communicated (no copy in, no copy out), and a full bucket's all-reduce overlaps the rest of backward.

    buckets[k].buffer : [numel_k]  (dtype of its parameters; one dtype per bucket)
    param.grad        : buffer[offset : offset + param.numel()].view(param.shape)
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shardwise.comm.collectives import Comm, Handle
from shardwise.comm.ring import batches_steps
from shardwise.config import AllReduceImpl
from shardwise.config.resolved import LAST_BUCKET_DIVISOR, gradient_bucket_numel
from shardwise.comm.device import device_guard
from shardwise.errors import UserError
from shardwise.parallel.replicas import ReplicaComms, split_by_replicas

if TYPE_CHECKING:
    from shardwise.comm.shm import SharedBuffers

_log = logging.getLogger(__name__)


@dataclass
class Bucket:
    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    ready: set[int] = field(default_factory=set)   # ids of params whose gradient is final this step
    handle: Handle | Future | None = None
    # views[i] = buffer[offsets[i] : offsets[i] + numel].view(shape) of params[i], built once: creating them
    # in every hook and every zero_grad cost ~1.4 ms per step on the tiny GPT (69 parameters).
    views: list[torch.Tensor] = field(default_factory=list)
    staged: torch.Tensor | None = None   # the buffer cast to communication_data_type while in flight
    # A plain loop's bucket whose .grads were all None at forward (`reclaim_grads`): the parameters keep None, and
    # each new gradient autograd hands over is copied into its slot by the hook (one pass instead of a zero fill
    # and an in-place add).
    fresh: bool = False
    written: set[int] = field(default_factory=set)   # slots a fresh bucket's hook wrote this backward
    # With prescale, each slot is divided by its hook as its gradient is final (still in cache; the launch then
    # waits for no division): the slots divided so far in this backward.
    divided: set[int] = field(default_factory=set)
    # The parameters' own replica group (`parallel/replicas.py`: experts' expert-dp group), summed over instead of
    # the runtime's dp group; None: the dp group. The mean still divides by the dp size.
    comm: Comm | None = None


def plan_buckets(sizes: list[int], bucket_numel: int, *, last_numel: int | None = None) -> list[list[int]]:
    """Greedy split of parameter sizes (already in launch order) into buckets of at most `bucket_numel`
    elements; a parameter larger than the limit gets a bucket of its own. Returns indices per bucket.

    `last_numel`: the bucket launched last holds at most this many elements (the split is then made from the end
    of the launch order, so the first bucket takes the remainder). Its all-reduce starts after the last gradient
    of backward and overlaps nothing; a small last bucket lets the one before it launch while the backward of the
    last parameters still runs, so only a small all-reduce is left exposed."""
    if last_numel is not None:
        from_end = _greedy(sizes[::-1], last_numel, bucket_numel)
        n = len(sizes)
        return [[n - 1 - i for i in reversed(b)] for b in reversed(from_end)]
    return _greedy(sizes, bucket_numel, bucket_numel)


def _greedy(sizes: list[int], first_numel: int, bucket_numel: int) -> list[list[int]]:
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, n in enumerate(sizes):
        limit = first_numel if not buckets else bucket_numel
        if current and filled + n > limit:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += n
    if current:
        buckets.append(current)
    return buckets


class OrderedLauncher:
    """Launch buckets strictly in index order once all their parameters' gradients are ready.

    Shared by the stage-0 all-reduce and the ZeRO-1/2 reduce-scatter: bucket k launches only after buckets < k,
    so every rank issues its collectives in the same order even if hooks fire in a slightly different order.
    Subclasses set `self.buckets` (each with `.ready`,
    a set of parameter ids, and `.params`) and `self.comm` (the dp group), and implement `_launch(bucket)`.
    Both keep every parameter whole on every rank, which the last two methods rely on."""

    buckets: list
    comm: Comm

    def param_storage_keys(self) -> set[int]:
        """Parameters keep their own storages here; the engine already knows them."""
        return set()

    def release_gathered(self) -> None:
        """Nothing is gathered: every rank keeps its parameters whole."""

    def gathered_state_dict(self, module: torch.nn.Module, *, rank0_only: bool = True
                            ) -> dict[str, torch.Tensor] | None:
        """The module's own state: every dp rank holds all of it (no communication)."""
        if rank0_only and self.comm.rank != 0:
            return None
        return {k: v.detach() for k, v in module.state_dict().items()}

    def _reset_launches(self) -> None:
        self._next_launch = 0
        self._ready_count = 0
        # For each bucket launched this step: how many gradients were ready at launch. Fewer than all of them
        # means the collective started while backward was still running.
        self.launch_log: list[int] = []

    def _mark_ready(self, bucket, p: torch.nn.Parameter) -> None:
        bucket.ready.add(id(p))
        self._ready_count += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not force and len(bucket.ready) < len(bucket.params):
                return
            self.launch_log.append(self._ready_count)
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket) -> None:
        raise NotImplementedError


class BucketedAllReduce(OrderedLauncher):
    """The data-parallel runtime of plain data parallelism (ZeRO stage 0): gradient all-reduce.

    With `AllReduceImpl.SHM` the buffers themselves live in shared memory that every rank of the group maps
    (`shardwise.comm.shm`), so the all-reduce reads the peers' gradients in place instead of through sockets.
    """

    def __init__(self, params: list[torch.nn.Parameter], comm: Comm, *, bucket_numel: int | None,
                 impl: AllReduceImpl = AllReduceImpl.BACKEND, predivide_factor: float = 1.0,
                 comm_dtype: torch.dtype | None = None, prescale: bool = False):
        self.comm = comm
        self._size = comm.size          # the group's size, asked once: every division uses it
        self.prescale = prescale        # DeepSpeed's prescale_gradients: divide by dp size before summing
        self.comm_dtype = comm_dtype    # DeepSpeed's communication_data_type: reduce in this dtype
        self.impl = impl
        self.predivide_factor = predivide_factor
        self.enabled = False       # set per backward: True only on gradient-accumulation boundaries
        self._divide_each = False  # set per backward: the hooks divide each gradient (prescale, communicating)
        self._executor: ThreadPoolExecutor | None = None
        self._reset_launches()
        params = [p for p in params if p.requires_grad]
        # Reverse registration order approximates the order gradients become ready in backward, so the first
        # bucket is usually complete while most of backward is still to run.
        order = list(reversed(params))
        self.buckets: list[Bucket] = []
        # Buckets never mix replica groups: each is summed over one group.
        replica_comms = ReplicaComms(comm.ledger)
        groups, bucket_comms = [], []
        for replicas, part in split_by_replicas(order):
            made = self._group_by_dtype(part, bucket_numel)
            groups += made
            bucket_comms += [replica_comms.of(replicas)] * len(made)
        self._shared = None
        if impl is AllReduceImpl.AUTO:
            self.impl = self._auto_shared(groups)
        elif impl is AllReduceImpl.SHM and not comm.local:
            self._shared = self._shared_buffers(groups)
        for b, group in enumerate(groups):
            total = sum(p.numel() for p in group)
            buffer = self._shared.local[b] if self._shared is not None else \
                torch.zeros(total, dtype=group[0].dtype, device=group[0].device)
            offsets, off = [], 0
            for p in group:
                offsets.append(off)
                off += p.numel()
            views = [buffer[o:o + p.numel()].view(p.shape) for o, p in zip(offsets, group)]
            self.buckets.append(Bucket(b, group, offsets, buffer, views=views, comm=bucket_comms[b]))
        self._where = {id(p): (bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)}
        self.attach_grads()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    @staticmethod
    def _group_by_dtype(order: list[torch.nn.Parameter], bucket_numel: int | None) -> list[list[torch.nn.Parameter]]:
        """Buckets of one dtype each, of `bucket_numel` elements (None: `DEFAULT_BUCKET_BYTES` of that dtype)."""
        groups: list[list[torch.nn.Parameter]] = []
        for dtype in dict.fromkeys(p.dtype for p in order):  # first-seen order
            same = [p for p in order if p.dtype == dtype]
            limit = gradient_bucket_numel(bucket_numel, zero_stage=0, element_size=same[0].element_size())
            # The last bucket a quarter of the others: on the small GPT (2 ranks, gloo, 25 MB buckets) the wait
            # after backward fell from ~70 to ~22 ms; see plan_buckets.
            last = max(limit // LAST_BUCKET_DIVISOR, 1)
            groups += [[same[i] for i in idx]
                       for idx in plan_buckets([p.numel() for p in same], limit, last_numel=last)]
        return groups

    def _auto_shared(self, groups: list[list[torch.nn.Parameter]]) -> AllReduceImpl:
        """"auto": shared memory for CPU gradients over a CPU backend when every rank can map the others'
        buckets; else the backend. Every refusal is the same on every rank (decided by what all of them share,
        or agreed), so every rank falls back together."""
        if self.comm.local:
            return AllReduceImpl.BACKEND
        try:
            self._shared = self._shared_buffers(groups)
        except UserError as e:
            _log.info("all_reduce = 'auto' uses the process group's all_reduce: %s", e)
            return AllReduceImpl.BACKEND
        return AllReduceImpl.SHM

    def _shared_buffers(self, groups: list[list[torch.nn.Parameter]]) -> "SharedBuffers":
        """The buckets' buffers in memory every rank of the group maps (`shardwise.comm.shm`); collective."""
        from shardwise.comm.shm import SharedBuffers
        off_host = next((p.device for g in groups for p in g if p.device.type != "cpu"), None)
        if off_host is not None:
            raise UserError(f"all_reduce = 'shm': the gradients are on {off_host}; the shared-memory all-reduce is "
                            f"for CPU training (on GPUs the backend, NCCL, is the fast path): use all_reduce = "
                            f"'backend'")
        if self.comm_dtype is not None and any(g[0].dtype != self.comm_dtype for g in groups):
            raise UserError(f"all_reduce = 'shm' with communication_data_type {self.comm_dtype}: the shared-memory "
                            f"all-reduce sums in the gradients' own dtype; remove communication_data_type or use "
                            f"all_reduce = 'backend'")
        return SharedBuffers.create(self.comm, [(sum(p.numel() for p in g), g[0].dtype) for g in groups])

    # -- gradient storage ---------------------------------------------------------------------------
    def attach_grads(self) -> None:
        """Point every .grad at its slot in the bucket buffers (after zeroing, or if a user reset grads)."""
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not view:
                    p.grad = view

    @torch.no_grad()
    def reclaim_grads(self) -> None:
        """Before a plain loop's backward: a bucket whose .grads are all None
        (optimizer.zero_grad's default) stays so and is filled by the hooks (`Bucket.fresh`); otherwise a .grad set
        to None gets its slot back zeroed and one the user replaced is copied into its slot, so backward
        accumulates in place."""
        for bucket in self.buckets:
            bucket.fresh = all(p.grad is None for p in bucket.params)
            if bucket.fresh:
                bucket.written.clear()
                continue
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None:
                    view.zero_()
                elif p.grad is not view:
                    view.copy_(p.grad)
                p.grad = view

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.ready.clear()
            bucket.handle = None
        self._next_launch = 0
        self._ready_count = 0
        self.launch_log = []
        self.attach_grads()

    @property
    def accumulates_locally(self) -> bool:
        """Gradients stay whole on every rank: a backward off the boundary just accumulates into them."""
        return True

    @property
    def grad_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    # -- communication ------------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        bucket, i = self._where[id(p)]
        view = bucket.views[i]
        grad = p.grad
        divide = self._divide_each and i not in bucket.divided     # once per backward, after the last add
        # autograd accumulates into the attached view in place (same object); a new tensor means it was replaced
        if grad is not None and grad is not view and grad.data_ptr() != view.data_ptr():
            if bucket.fresh and i not in bucket.written:
                # the slot holds last step's values: write it whole (divided on the way when prescaling)
                bucket.written.add(i)
                if divide:
                    torch.div(grad, self._size, out=view)
                else:
                    view.copy_(grad)
            else:
                # someone replaced .grad after autograd had it in place: fold it back in
                view.copy_(grad)
                if divide:
                    view.div_(self._size)
            p.grad = view
        elif divide:
            view.div_(self._size)
        if divide:
            bucket.divided.add(i)
        if not self.enabled:
            return
        self._mark_ready(bucket, p)

    def _hooks_divide(self) -> bool:
        """Whether each gradient is divided by the dp size in its hook (prescale): the launch divides the rest."""
        return self.prescale

    @torch.no_grad()
    def settle_fresh(self, bucket: Bucket) -> None:
        """A fresh bucket before its launch: slots of parameters that got no gradient are zeroed (nothing to
        divide) and every .grad views its slot again."""
        if not bucket.fresh:
            return
        for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
            if i not in bucket.written:
                view.zero_()
                p.grad = view
                bucket.divided.add(i)
        bucket.fresh = False

    @torch.no_grad()
    def _divide_rest(self, bucket: Bucket) -> None:
        """Prescale at launch: the slots no hook divided (parameters without a gradient in this backward)."""
        if not bucket.divided:
            bucket.buffer.div_(self._size)
        elif len(bucket.divided) < len(bucket.params):
            for i, view in enumerate(bucket.views):
                if i not in bucket.divided:
                    view.div_(self._size)

    def _launch(self, bucket: Bucket) -> None:
        self.settle_fresh(bucket)
        if self.prescale:
            self._divide_rest(bucket)
        elif self.predivide_factor != 1.0:
            bucket.buffer.div_(self.predivide_factor)
        wire = bucket.buffer
        if self.comm_dtype is not None and self.comm_dtype != wire.dtype:
            bucket.staged = wire = wire.to(self.comm_dtype)
        if bucket.comm is not None:
            # A replica subgroup (experts): the backend's all-reduce over it (ring and shm serve the dp group).
            bucket.handle = bucket.comm.all_reduce(wire, async_op=True)
        elif self.impl is AllReduceImpl.RING and batches_steps(wire):
            # A device buffer: one batched exchange per step, launched here on the thread that runs backward
            # for this device (NCCL p2p from a worker thread would run on GPU 0's context); the waits only order
            # streams, so backward goes on while the ring's kernels run.
            with device_guard(wire.device):
                bucket.handle = self.comm.ring_all_reduce(wire, async_op=True)
        elif self.impl is AllReduceImpl.RING:
            # On gloo the ring is built from blocking p2p calls; a single worker thread keeps buckets in
            # launch order on every rank while the main thread carries on with backward.
            bucket.handle = self._comm_thread().submit(self.comm.ring_all_reduce, wire)
        elif self._shared is not None:
            # blocking too (two barriers around reads and writes of the peers' mapped buffers), on the same thread
            bucket.handle = self._comm_thread().submit(self.comm.shm_all_reduce, self._shared, bucket.index)
        else:
            bucket.handle = self.comm.all_reduce(wire, async_op=True)

    def _comm_thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-allreduce")
        return self._executor

    def begin_backward(self, boundary: bool) -> None:
        """Communicate only for the backward of the last micro-batch of a global batch."""
        self.enabled = boundary and not self.comm.local
        self._divide_each = self.enabled and self._hooks_divide()
        for bucket in self.buckets:
            bucket.divided.clear()
        self.launch_log = []

    def end_backward(self, boundary: bool) -> None:
        if boundary:
            self.finish()

    def finish(self) -> None:
        """After backward on a boundary micro-batch: launch what is left (parameters that got no
        gradient keep zeros), wait for every bucket, and turn sums into means: sum over the dp group, then divide by
        dp size (optionally pre-divided by `gradient_predivide_factor`, as DeepSpeed does), which is the exact
        mean when every rank's loss is the mean over an equal number of samples."""
        if not self.comm.local:
            self._launch_ready(force=True)
        for bucket in self.buckets:
            if isinstance(bucket.handle, Future):
                bucket.handle.result()          # re-raises a communication error from the ring thread
            elif bucket.handle is not None:
                bucket.handle.wait()
            if bucket.staged is not None:
                bucket.buffer.copy_(bucket.staged)
                bucket.staged = None
            if not self.comm.local and not self.prescale:
                if self.predivide_factor != 1.0:
                    bucket.buffer.mul_(self.predivide_factor / self._size)
                else:
                    bucket.buffer.div_(self._size)
            bucket.handle = None
            bucket.ready.clear()
        self._next_launch = 0
        self._ready_count = 0

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
