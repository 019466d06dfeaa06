"""ZeRO-1/2 gradient reduction (`ZeroGradReducer`): buckets reduce-scattered as backward fills them."""

from __future__ import annotations

import torch

from shardwise.comm.collectives import Comm
from shardwise.errors import UserError
from shardwise.parallel.data_parallel import OrderedLauncher
from shardwise.parallel.zero.buckets import ZeroBucket
from shardwise.parallel.zero.copies import discard_sent


class UnusedParametersError(UserError, AssertionError):
    """A trainable parameter got no gradient in a whole global batch while zero_optimization.ignore_unused_parameters
    is false; an AssertionError too, as DeepSpeed raises."""


class ZeroGradReducer(OrderedLauncher):
    """Stage 1 (`partition_grads=False`): full gradients are kept (each .grad a view of its bucket's persistent
    `grad_buffer` [padded]) and accumulate locally over micro-batches; on the accumulation boundary each bucket is
    reduce-scattered into `grad_shard` [S] as soon as backward has produced all of its gradients.

    Stage 2 (`partition_grads=True`): no full gradient survives backward. When a parameter's gradient is ready it
    is copied into its bucket's transient `grad_buffer` and `.grad` is dropped; a complete bucket is
    reduce-scattered at once (every micro-batch) and the result added into `grad_shard`; at most `max_in_flight`
    bucket buffers exist at a time, so gradient memory is the shard plus a few buckets.

    Both average by summing over the dp group and dividing by its size. Buckets launch in index order on every
    rank, so collectives match across ranks. On gloo the reduce-scatter is a pairwise exchange
    (`Comm.reduce_scatter_sum`): gloo's own runs a full all-reduce, 3x slower at 1M fp32 elements on 2 ranks.

    `require_all_used`: a global batch in which some parameter got no gradient raises `UnusedParametersError` at
    its last backward (DeepSpeed's check with offload_optimizer and ignore_unused_parameters false)."""

    def __init__(self, buckets: list[ZeroBucket], comm: Comm, *, partition_grads: bool, max_in_flight: int = 2,
                 require_all_used: bool = False):
        self.buckets = buckets
        self.require_all_used = require_all_used
        self._used: set[int] = set()           # ids of the parameters that got a gradient in this global batch
        self.comm = comm
        self.partition_grads = partition_grads
        self.max_in_flight = max_in_flight
        self.enabled = False
        self._boundary = False
        self._in_flight: list[ZeroBucket] = []
        self._reset_launches()
        self._where = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        if not partition_grads:
            for b in buckets:
                b.grad_buffer = torch.zeros_like(b.param_flat)
                b.grad_views = b.flat_views(b.grad_buffer)
                # Stage 1 keeps full gradients anyway: its averaged shard lives in place, in the buffer.
                b.grad_shard = b.grad_buffer[b.shard]
            self._attach_grads()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for b in buckets for p in b.params]

    def _attach_grads(self) -> None:
        for b in self.buckets:
            for p, view in zip(b.params, b.grad_views):
                if p.grad is not view:
                    p.grad = view

    # -- engine interface ---------------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        self.enabled = self.partition_grads or boundary
        self._boundary = boundary
        discard_sent(b.host for b in self.buckets)

    def end_backward(self, boundary: bool) -> None:
        if self.enabled:
            self._launch_ready(force=True)
            self._drain(0)
            self._next_launch = 0
            self._ready_count = 0
            for b in self.buckets:
                b.ready.clear()
        if boundary:
            used, self._used = self._used, set()
            unused = [p for b in self.buckets for p in b.params if id(p) not in used]
            if self.require_all_used and unused:
                shapes = ", ".join(str(tuple(p.shape)) for p in unused[:3])
                raise UnusedParametersError(
                    f"{len(unused)} trainable parameter(s) (shapes {shapes}{', ...' if len(unused) > 3 else ''}) got "
                    f"no gradient in this global batch: set zero_optimization.ignore_unused_parameters to true, or "
                    f"make every trainable parameter take part in the loss")

    def zero_grad(self) -> None:
        for b in self.buckets:
            (b.grad_shard if self.partition_grads else b.grad_buffer).zero_()
            b.ready.clear()
        discard_sent(b.host for b in self.buckets)
        if not self.partition_grads:
            self._attach_grads()
        self.launch_log = []

    @property
    def accumulates_locally(self) -> bool:
        """Stage 1 keeps full gradients between boundaries; stage 2 reduce-scatters each as it is produced."""
        return not self.partition_grads

    @property
    def grad_bytes(self) -> int:
        held = [b.grad_shard if self.partition_grads else b.grad_buffer for b in self.buckets]
        return sum(t.numel() * t.element_size() for t in held)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    # -- hooks and launches -------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        bucket, i = self._where[id(p)]
        self._used.add(id(p))
        if self.partition_grads:
            if not self.enabled:
                return
            if bucket.grad_buffer is None:
                bucket.grad_buffer = torch.zeros_like(bucket.param_flat)
            assert p.grad is not None            # a post-accumulate-grad hook runs once .grad is set
            off, n = bucket.layout.offsets[i], bucket.layout.sizes[i]
            bucket.grad_buffer[off:off + n].copy_(p.grad.reshape(-1))
            p.grad = None            # the full gradient is not kept: that is stage 2's saving
        else:
            view = bucket.grad_views[i]
            assert p.grad is not None            # a post-accumulate-grad hook runs once .grad is set
            if p.grad is not view:   # someone replaced .grad: fold it back into the bucket
                view.copy_(p.grad)
                p.grad = view
            if not self.enabled:
                return
        self._mark_ready(bucket, p)

    def _launch(self, bucket: ZeroBucket) -> None:
        if bucket.grad_buffer is None:          # stage 2: no parameter of it got a gradient
            bucket.grad_buffer = torch.zeros_like(bucket.param_flat)
        self._drain(self.max_in_flight - 1 if self.partition_grads else len(self.buckets))
        # The output is a separate [S] tensor: it must not alias the input, which holds the shard in stage 1.
        out = torch.empty_like(bucket.grad_shard)
        bucket.received = out
        # tag: buckets in flight at once exchange on the group under different tags
        comm = bucket.comm if bucket.comm is not None else self.comm
        bucket.handle = comm.reduce_scatter_sum(out, bucket.grad_buffer, tag=bucket.index, async_op=True)
        self._in_flight.append(bucket)

    def _drain(self, keep: int) -> None:
        """Complete launched buckets, oldest first, until at most `keep` remain in flight."""
        while len(self._in_flight) > keep:
            bucket = self._in_flight.pop(0)
            # `_launch` set both before it put the bucket in flight
            assert bucket.handle is not None and bucket.received is not None
            bucket.handle.wait()
            bucket.handle = None
            received = bucket.received
            if self.partition_grads:
                bucket.grad_shard.add_(received.div_(self.comm.size))
                bucket.grad_buffer = None             # free the full-size buffer
            else:                                     # sum / N straight into the shard: one pass
                torch.div(received, self.comm.size, out=bucket.grad_shard)
            bucket.received = None
            if bucket.host is not None and self._boundary:
                # Offloaded masters: the final shard leaves for the host now, on a side stream, while backward
                # goes on with the next buckets (the step then waits for this bucket's event only).
                bucket.host.send(bucket.grad_shard)
