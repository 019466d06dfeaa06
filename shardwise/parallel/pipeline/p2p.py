"""Point-to-point transport of one pipeline stage: tags, shape headers, receive buffers, send completion.

Everything goes through the stage's `Comm` (group ranks = stage indices), so the ledger records every
activation and gradient that crosses stages.

Rules that keep a pipeline deadlock-free and its memory bounded:

- Sends are asynchronous and never waited on by the compute thread (a blocked send is what deadlocks
  1F1B, see `simulate.SendMode`). A `SendReaper` thread waits on each send and then drops the last
  reference to its buffer, so an activation's memory is returned as soon as its send has completed.
- Receives are posted early (the runtime posts the next action's receive before running the current
  one) and waited on only right before the action that needs them.
- Tags are unique per `Message` and tensor (`message_tag`), so early receives never match the wrong
  message whatever order the peer sends in.

Shapes. The first activation crossing each model-chunk boundary in a step is preceded by a shape header
(`HEADER_LEN` int64: micro-batch, count, then dtype, requires_grad, ndim, dims per tensor); every later
micro-batch of the step must have the same shapes (checked on the sending side). Gradients need no
header: they have the shapes of the activations the receiving stage produced itself.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from shardwise.comm.collectives import Comm, Handle
from shardwise.parallel.pipeline.schedules import Message, Op, PipelineError

HEADER_LEN = 64
MAX_TENSORS = 16
"""Most tensors one activation may hold (a tuple passed between layers)."""

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


def message_tag(message: Message, index: int, num_model_chunks: int) -> int:
    """A tag unique to (message, tensor index); tags below ``num_model_chunks`` are the shape headers."""
    if not 0 <= index < MAX_TENSORS:
        raise PipelineError(f"an activation holds {index + 1} tensors; at most {MAX_TENSORS} can cross stages")
    slot = (message.microbatch * num_model_chunks + message.source) * 2 + (message.op is Op.BACKWARD)
    return num_model_chunks + slot * MAX_TENSORS + index


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


class SendReaper:
    """Waits on sends off the compute thread and frees their buffers once sent (see the module docstring)."""

    def __init__(self, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardwise-pipe-send")
        self._pending: list[Future] = []

    def track(self, handle: Handle, buffers: list[Tensor]) -> None:
        def wait(held: list[Tensor] = buffers) -> None:
            handle.wait()
            held.clear()  # the last reference to the sent storage (the runtime dropped its own)

        self._pending.append(self._pool.submit(wait))

    def drain(self) -> None:
        """Wait for every send of the step; re-raises a failed send."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass
class _Posted:
    handles: list[Handle]
    buffers: list[Tensor]


class Wire:
    """Sends and receives of one stage. `begin_step` forgets the previous step's shapes."""

    def __init__(self, comm: Comm, *, num_model_chunks: int, device: torch.device) -> None:
        self.comm = comm
        self.num_model_chunks = num_model_chunks
        self.device = device
        self.reaper = SendReaper()
        self._sent_shapes: dict[int, list[TensorMeta]] = {}    # source chunk -> shapes announced this step
        self._recv_shapes: dict[int, list[TensorMeta]] = {}    # source chunk -> shapes announced to us
        self._header_recv: dict[int, tuple[Handle, Tensor]] = {}
        self._posted: dict[Message, _Posted] = {}

    def begin_step(self) -> None:
        self._sent_shapes.clear()
        self._recv_shapes.clear()
        self._header_recv.clear()
        if self._posted:
            raise PipelineError(f"receives left over from the previous step: {', '.join(map(str, self._posted))}")

    def end_step(self) -> None:
        """Every send of the step completed (their buffers freed)."""
        self.reaper.drain()

    # -- sending ------------------------------------------------------------------------------------
    def send(self, message: Message, peer: int, tensors: list[Tensor], requires_grad: Sequence[bool] = ()) -> None:
        """Post the sends of ``tensors`` (contiguous, detached); they are freed once sent. ``requires_grad``
        (activations): which of them the receiver must treat as needing a gradient."""
        flags = list(requires_grad) or [False] * len(tensors)
        metas = [TensorMeta(tuple(t.shape), t.dtype, g) for t, g in zip(tensors, flags)]
        if message.op is Op.FORWARD:
            announced = self._sent_shapes.get(message.source)
            if announced is None:
                self._sent_shapes[message.source] = metas
                header = encode_header(message.microbatch, metas).to(self.device)
                self.reaper.track(self.comm.isend(header, peer, tag=message.source), [header])
            elif [(m.shape, m.dtype) for m in announced] != [(m.shape, m.dtype) for m in metas]:
                raise PipelineError(f"the {message} has shapes {', '.join(map(str, metas))} but this step's first "
                                    f"micro-batch had {', '.join(map(str, announced))}: every micro-batch of a "
                                    f"step must have the same shapes (use equal micro-batch and sequence sizes)")
        for i, t in enumerate(tensors):
            handle = self.comm.isend(t, peer, tag=message_tag(message, i, self.num_model_chunks))
            self.reaper.track(handle, [t])

    # -- receiving ----------------------------------------------------------------------------------
    def post(self, message: Message, peer: int, metas: list[TensorMeta] | None = None) -> bool:
        """Post the receive of ``message`` if its shapes are known (``metas`` for gradients; the header for
        activations, whose receive is posted on its first use). Returns whether it is posted."""
        if message in self._posted:
            return True
        if metas is None:
            self._post_header(message.source, peer)
            metas = self._recv_shapes.get(message.source)
            if metas is None:
                return False
        buffers = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
        handles = [self.comm.irecv(b, peer, tag=message_tag(message, i, self.num_model_chunks))
                   for i, b in enumerate(buffers)]
        self._posted[message] = _Posted(handles, buffers)
        return True

    def take(self, message: Message, peer: int, metas: list[TensorMeta] | None = None) -> list[Tensor]:
        """Wait for ``message`` and return its tensors (``requires_grad`` set as announced, for activations)."""
        if message not in self._posted and metas is None and message.source not in self._recv_shapes:
            self._post_header(message.source, peer)
            handle, header = self._header_recv[message.source]
            handle.wait()
            microbatch, self._recv_shapes[message.source] = decode_header(header)
            if microbatch != message.microbatch:
                raise PipelineError(f"stage {self.comm.rank}: the shape header of model chunk {message.source} "
                                    f"came with micro-batch {microbatch}, but micro-batch {message.microbatch} is "
                                    f"received first: the stages' schedules disagree on the forward order")
        self.post(message, peer, metas)
        posted = self._posted.pop(message)
        for h in posted.handles:
            h.wait()
        if metas is None:
            for b, m in zip(posted.buffers, self._recv_shapes[message.source]):
                b.requires_grad_(m.requires_grad)
        return posted.buffers

    def _post_header(self, source: int, peer: int) -> None:
        if source not in self._header_recv and source not in self._recv_shapes:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            self._header_recv[source] = (self.comm.irecv(header, peer, tag=source), header)

    def close(self) -> None:
        self.reaper.close()
