"""Point-to-point transport of one pipeline stage: shape headers, receive buffers, send completion (`Wire`).

Everything goes through the stage's `Comm` (group ranks = stage indices), so the ledger records every
activation and gradient that crosses stages. `comm_plan` explains why its batch order cannot deadlock or mismatch
under NCCL, which matches messages by order and ignores tags. Every message therefore uses tag 0, with gloo too,
so the CPU tests run the very matching NCCL does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from shardwise.comm.collectives import Comm, Handle
from shardwise.parallel.pipeline.comm_plan import Batch, Step
from shardwise.parallel.pipeline.schedules import Message, Op, PipelineError

HEADER_LEN = 64
"""int64 values in a shape header; it bounds how many tensors (and dimensions) an activation may hold."""

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate one tensor of a message."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: Tensor) -> "TensorMeta":
        return cls(tuple(t.shape), t.dtype, bool(t.requires_grad))

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


def encode_header(microbatch: int, metas: Sequence[TensorMeta]) -> Tensor:
    values = [microbatch, len(metas)]
    for m in metas:
        if m.dtype not in _DTYPES:
            raise PipelineError(f"an activation of dtype {m.dtype} cannot cross stages; supported: "
                                f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}")
        values += [_DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
    if len(values) > HEADER_LEN:
        raise PipelineError(f"the activation's shape header needs {len(values)} numbers (more than {HEADER_LEN}): "
                            f"pass fewer tensors or tensors with fewer dimensions between stages")
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def decode_header(header: Tensor) -> tuple[int, list[TensorMeta]]:
    values = header.tolist()
    microbatch, count, pos, metas = values[0], values[1], 2, []
    for _ in range(count):
        dtype, grad, ndim = values[pos:pos + 3]
        metas.append(TensorMeta(tuple(values[pos + 3:pos + 3 + ndim]), _DTYPES[dtype], bool(grad)))
        pos += 3 + ndim
    return microbatch, metas


@dataclass
class _Posted:
    handles: list[Handle]
    buffers: list[Tensor]


@dataclass
class Outgoing:
    """An output waiting in the outbox for its batch: contiguous, detached tensors, and for activations which
    of them the receiver must treat as needing a gradient."""

    tensors: list[Tensor]
    requires_grad: list[bool]


class Wire:
    """Sends and receives of one stage; shapes announced and received are kept for the runtime's lifetime.

    - Sends are never waited on by the compute thread before the end of the step (a blocked send is what
      deadlocks 1F1B, see `simulate.SendMode`). Each batch first drops the sends that completed since the last
      one, with the last reference to their buffers: an activation's memory is returned by the first batch
      after its send completed.
    - Receives are posted at the tick their data is sent (under NCCL; with gloo a few actions earlier still,
      see `post_ahead`) and waited on only right before the action that needs them (`take`).
    """

    def __init__(self, comm: Comm, *, device: torch.device, eager_receives: bool | None = None,
                 join_first: bool | None = None) -> None:
        self.comm = comm
        self.device = device
        self.eager_receives = _host_async(comm) if eager_receives is None else eager_receives
        self._sent_shapes: dict[int, list[TensorMeta]] = {}    # source chunk -> shapes announced to the peer
        self._recv_shapes: dict[int, list[TensorMeta]] = {}    # source chunk -> shapes announced to us
        self._posted: dict[Message, _Posted] = {}
        self._sending: list[Handle] = []                       # sends in flight (each holds its buffer)
        self._incoming: dict[int, deque[Message]] = {}         # peer -> receives of the step not posted yet
        # NCCL creates a group's communicator on its first operation, which every rank must then join; a
        # batch only involves neighbours (torch's batch_isend_irecv documents the rule), so a barrier goes first.
        # ``join_first``: given by a second wire on a group whose first wire may have joined it already.
        self.join_first = dist.is_initialized() and "nccl" in comm.backend if join_first is None else join_first

    def begin_step(self, program: Sequence[Step]) -> None:
        if self._posted:
            raise PipelineError(f"receives left over from the previous step: {', '.join(map(str, self._posted))}")
        if self.join_first:
            self.comm.barrier()
            self.join_first = False
        self._incoming = {}
        for step in program:
            if isinstance(step, Batch):
                for r in step.recvs:
                    self._incoming.setdefault(r.peer, deque()).append(r.message)

    def end_step(self) -> None:
        """Wait for every send of the step (their buffers are freed)."""
        sending, self._sending = self._sending, []
        for h in sending:
            h.wait()

    def exchange(self, batch: Batch, outbox: dict[Message, Outgoing],
                 grad_metas: Callable[[Message], list[TensorMeta] | None]) -> None:
        """Post ``batch`` (the sends and receives of one tick of the stage's `comm_plan` program) as one
        ``batch_isend_irecv``: the sends of its messages (taken out of ``outbox``) and the receives of the
        messages peers send at its tick (unless `post_ahead` posted them already). ``grad_metas(message)``: the
        shapes of a gradient to receive."""
        self._sending = [h for h in self._sending if not h.is_completed()]
        sends = [(t, outbox.pop(t.message)) for t in batch.sends]
        self._agree_shapes(batch, sends)
        send_ops = [(x, t.peer) for t, out in sends for x in out.tensors]
        recv_ops, posted = [], []
        for r in batch.recvs:
            if r.message in self._posted:
                continue
            if self._incoming[r.peer][0] != r.message:
                raise AssertionError(f"receive of the {r.message} out of the grid order")   # comm_plan guarantees it
            self._incoming[r.peer].popleft()
            metas = self._metas(r.message, grad_metas)
            assert metas is not None, f"shapes of the {r.message} unknown at its batch"
            buffers = self._buffers(metas)
            recv_ops += [(b, r.peer) for b in buffers]
            posted.append((r.message, buffers))
        handles = self.comm.batch_isend_irecv(send_ops, recv_ops)
        self._sending += handles[:len(send_ops)]
        at = len(send_ops)
        for message, buffers in posted:
            self._posted[message] = _Posted(handles[at:at + len(buffers)], buffers)
            at += len(buffers)

    def post_ahead(self, message: Message, peer: int,
                   grad_metas: Callable[[Message], list[TensorMeta] | None]) -> None:
        """With host-asynchronous p2p (gloo) only: post now the receives from ``peer`` up to ``message``, in the
        grid order (the order the peer sends in), before their batches. gloo moves the data only once the receive
        is posted (a late one costs a round trip, ~0.4 ms here), and its posts never block, so this is safe; under
        NCCL an early receive would stall the stream in front of later batches, so it keeps to the grid. Stops at
        a receive whose shapes are not known yet (a gradient of a forward not run yet, an activation whose shape
        header has not come): those wait for their batch."""
        queue = self._incoming.get(peer)
        if not self.eager_receives or not queue:
            return
        while queue and message not in self._posted:
            metas = self._metas(queue[0], grad_metas)
            if metas is None:
                return
            buffers = self._buffers(metas)
            handles = self.comm.batch_isend_irecv([], [(b, peer) for b in buffers])
            self._posted[queue.popleft()] = _Posted(handles, buffers)

    def _buffers(self, metas: list[TensorMeta]) -> list[Tensor]:
        """Receive buffers for one message."""
        return [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]

    def _metas(self, message: Message, grad_metas: Callable[[Message], list[TensorMeta] | None]
               ) -> list[TensorMeta] | None:
        if message.op is Op.FORWARD:
            return self._recv_shapes.get(message.source)
        return grad_metas(message)

    def _agree_shapes(self, batch: Batch, sends: list[tuple[Any, Outgoing]]) -> None:
        """Headers of the activations that are the first across their boundary; the others are checked.

        Shapes are agreed once. The first activation crossing each model-chunk boundary is preceded by a shape
        header (`HEADER_LEN` int64: micro-batch, count, then dtype, requires_grad, ndim, dims per tensor), posted
        in a batch of its own at the same tick on both sides (so `comm_plan`'s argument still holds) and waited on
        at once. Later activations, in this step and the next ones, must have the same shapes (checked on the
        sending side). Gradients need no header: they have the shapes of the activations the receiving stage
        produced itself.
        """
        header_sends, header_recvs = [], []
        for t, out in sends:
            if t.message.op is not Op.FORWARD:
                continue
            metas = [TensorMeta(tuple(x.shape), x.dtype, g) for x, g in zip(out.tensors, out.requires_grad)]
            announced = self._sent_shapes.get(t.message.source)
            if announced is None:
                self._sent_shapes[t.message.source] = metas
                header_sends.append((encode_header(t.message.microbatch, metas).to(self.device), t.peer))
            elif announced != metas:
                raise PipelineError(f"the {t.message} has shapes {', '.join(map(str, metas))} but the first one "
                                    f"across this boundary had {', '.join(map(str, announced))}: shapes are agreed "
                                    f"once, so every micro-batch of every step must have the same shapes (use equal "
                                    f"micro-batch and sequence sizes)")
        for r in batch.recvs:
            if r.message.op is Op.FORWARD and r.message.source not in self._recv_shapes:
                header_recvs.append((r.message, torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device),
                                     r.peer))
        if not (header_sends or header_recvs):
            return
        handles = self.comm.batch_isend_irecv(header_sends, [(h, peer) for _, h, peer in header_recvs])
        self._sending += handles[:len(header_sends)]
        for (message, header, _), handle in zip(header_recvs, handles[len(header_sends):]):
            handle.wait()
            microbatch, self._recv_shapes[message.source] = decode_header(header)
            if microbatch != message.microbatch:
                raise PipelineError(f"stage {self.comm.rank}: the shape header of model chunk {message.source} "
                                    f"came with micro-batch {microbatch}, but micro-batch {message.microbatch} is "
                                    f"received first: the stages' schedules disagree on the forward order")

    def take(self, message: Message) -> list[Tensor]:
        """Wait for ``message`` (posted by an earlier `exchange`) and return its tensors (``requires_grad`` set
        as announced, for activations)."""
        posted = self._posted.pop(message)
        for h in posted.handles:
            h.wait()
        if message.op is Op.FORWARD:
            for b, m in zip(posted.buffers, self._recv_shapes[message.source]):
                b.requires_grad_(m.requires_grad)
        return posted.buffers

    def close(self) -> None:
        self.end_step()


def _host_async(comm: Comm) -> bool:
    """Whether the group's p2p operations are posted and progressed off any stream (gloo), so receives may be
    posted early (`Wire.post_ahead`)."""
    return dist.is_initialized() and comm.backend == "gloo"
