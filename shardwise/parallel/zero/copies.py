"""ZeRO-Offload's host<->device copies, arranged to overlap compute on a GPU and to move low-precision bytes.

    backward, bucket k final   side stream: grad shard [S] (bf16) -> pinned bf16 host [S], event_k
                               (stages 1-2: a bucket; stage 3: a unit's flat shard, or a persistent bucket)
    step, _load_grads          host waits event_k only; the host casts bf16 -> fp32 into the master's .grad
    step, _publish             the host casts the fp32 master -> pinned bf16 [S]; H2D bf16 (async), event
    stage 3, gather unit u     copy stream: pinned shard -> device, then the all-gather, while unit u-1 computes

Casting on the host halves the bytes on the bus (2 per element, not 4) compared with sending fp32 and casting on
the device. A pinned buffer is reused only after the event of its previous copy has completed. Streams and
events exist only on CUDA: on the CPU every copy is done when it returns, and these paths run the same
arithmetic (so the CPU tests check them exactly).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from shardwise.comm.device import side_stream


def pinned_like(t: torch.Tensor, *, dtype: torch.dtype | None = None, device: torch.device | None = None,
                pin: bool = True) -> torch.Tensor:
    """An empty host tensor shaped as `t` (in `dtype`), page-locked when CUDA exists (else an async copy from it
    would be a synchronous one)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=device or torch.device("cpu"),
                       pin_memory=pin and torch.cuda.is_available())


class CopyStream:
    """A side CUDA stream for offload copies on `device`; on the CPU, nothing (copies are synchronous there)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Queue `src` (device) -> `dst` (pinned host) behind the work queued so far on the current stream, on the
        side stream; returns the event that marks it done (None on the CPU: done already)."""
        if self.stream is None:
            dst.copy_(src)
            return None
        with side_stream(self.device, self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def stream_context(self) -> Any:
        """The block runs on the side stream after the current stream's queued work (nothing on the CPU)."""
        return side_stream(self.device, self.stream)

    def join(self) -> Any:
        """An event on the side stream now, for the current stream to wait on (None on the CPU)."""
        if self.stream is None:
            return None
        done = torch.cuda.Event()
        done.record(self.stream)
        return done


class HostGrad:
    """The pinned host copy [S] (model dtype) of one shard's final gradient, sent on the boundary's backward as
    soon as the shard's reduction is done, read by the step after waiting for that copy only. Allocated once:
    every step reuses it (the next send is queued on the same side stream, after the previous copy)."""

    def __init__(self, grad_shard: torch.Tensor, copies: CopyStream):
        self.buffer = pinned_like(grad_shard)
        self.copies = copies
        self.event: Any = None
        self.pending = False              # the buffer holds the current gradient (or will, once `event` is done)

    def send(self, grad_shard: torch.Tensor) -> None:
        self.event = self.copies.to_host(self.buffer, grad_shard)
        self.pending = True

    def receive(self) -> torch.Tensor:
        """The sent gradient, once its copy is done (blocks the host on that copy alone)."""
        wait_host(self.event)
        self.pending, self.event = False, None
        return self.buffer

    def discard(self) -> None:
        """The device shard changes again (zeroed, or another backward adds to it): what was sent is stale."""
        self.pending, self.event = False, None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def discard_sent(hosts: Iterable[HostGrad | None]) -> None:
    """Before the device gradient shards change (a backward begins, gradients are zeroed): their host copies
    are stale."""
    for h in hosts:
        if h is not None:
            h.discard()


def wait_host(event: Any) -> None:
    """Block the host until `event` has completed (nothing for None)."""
    if event is not None:
        event.synchronize()


def wait_stream(event: Any, device: torch.device) -> None:
    """Make the current stream of `device` wait for `event` (nothing for None)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
