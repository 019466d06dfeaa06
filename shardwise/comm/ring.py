"""Our own ring all-reduce over point-to-point sends: reduce-scatter, then all-gather.

    ring_all_reduce(flat_grads, group)   # in place, as dist.all_reduce(flat_grads, group=group)

Host tensors (gloo) walk a pipeline of segments (`_run`); device tensors take one batched exchange per step
(`_run_batched`, as NCCL needs). Nothing here is global, so it may run on a background thread (the data-parallel
engine's communication thread), but two ring all-reduces must not run at the same time on one process group:
they would use the same tags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

# [Note: tuning]
# On gloo over loopback TCP every message costs a ready-notification, a write and a read wake-up, a fixed price
# that 1 MiB segments (gloo's own choice) pay too often; 4 MiB segments with 4 receives in flight measured best
# for 16-256 MiB tensors on 2 ranks (benchmarks/allreduce.py sweeps both knobs: --segment-kb, --in-flight).
# A chunk smaller than a segment goes as one message per step.
DEFAULT_SEGMENT_BYTES = 4 << 20
DEFAULT_IN_FLIGHT = 4             # receives posted ahead of the segment being reduced

Reducer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (accumulator, incoming) -> accumulator, in place

# (op, name, in-place reduction, integer/bool dtypes only); dist.ReduceOp compares equal to its members
_REDUCERS: tuple[tuple[dist.ReduceOp.RedOpType, str, Reducer, bool], ...] = (
    (dist.ReduceOp.SUM, "SUM", lambda acc, x: acc.add_(x), False),
    (dist.ReduceOp.PRODUCT, "PRODUCT", lambda acc, x: acc.mul_(x), False),
    (dist.ReduceOp.MAX, "MAX", lambda acc, x: torch.maximum(acc, x, out=acc), False),
    (dist.ReduceOp.MIN, "MIN", lambda acc, x: torch.minimum(acc, x, out=acc), False),
    (dist.ReduceOp.BAND, "BAND", lambda acc, x: acc.bitwise_and_(x), True),
    (dist.ReduceOp.BOR, "BOR", lambda acc, x: acc.bitwise_or_(x), True),
    (dist.ReduceOp.BXOR, "BXOR", lambda acc, x: acc.bitwise_xor_(x), True),
)


def _reducer(op: object, dtype: torch.dtype) -> Reducer:
    """The in-place elementwise reduction for `op` (a `dist.ReduceOp` member) on `dtype`."""
    for member, name, fn, integer_only in _REDUCERS:
        if op == member:
            if integer_only and (dtype.is_floating_point or dtype.is_complex):
                raise ValueError(f"ring_all_reduce: op=ReduceOp.{name} needs an integer or bool tensor, "
                                 f"got dtype {dtype}; use SUM/PRODUCT/MAX/MIN for floating point")
            return fn
    supported = ", ".join(name for _, name, _, _ in _REDUCERS)
    raise ValueError(f"ring_all_reduce: op={op!r} is not supported; the ring supports ReduceOp."
                     f"{{{supported}}} (for AVG, reduce with SUM and divide by the group size)")


@dataclass(frozen=True)
class RingPlan:
    """Pure index arithmetic of one ring all-reduce of `numel` elements over `size` ranks.

    The flat tensor is cut into N = `size` chunks. In each of the N-1 reduce-scatter steps rank i sends one chunk
    to rank i+1 and adds the chunk it receives from rank i-1 into its own copy; after them rank i holds the fully
    reduced chunk (i+1) mod N. The N-1 all-gather steps pass the reduced chunks around the ring, each received
    straight into its place: 2(N-1)/N of the tensor each way per rank (the "bus bandwidth" factor of nccl-tests).

    Chunk c has `numel // size` elements, plus one for the first `numel % size` chunks, so chunk sizes
    differ by at most one and some may be empty. Every chunk is cut into `num_segments` segments of
    `segment_numel` elements (the last ones shorter or empty).
    """

    numel: int
    size: int
    segment_numel: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.numel < 0 or self.segment_numel < 1:
            raise ValueError(f"RingPlan needs size >= 1, numel >= 0, segment_numel >= 1; got {self}")

    @property
    def num_steps(self) -> int:
        """N-1 reduce-scatter steps followed by N-1 all-gather steps."""
        return 2 * (self.size - 1)

    @property
    def num_segments(self) -> int:
        return math.ceil(self.chunk_bounds(0)[1] / self.segment_numel)

    def chunk_bounds(self, chunk: int) -> tuple[int, int]:
        """(start, length) of chunk `chunk` in the flat tensor."""
        base, extra = divmod(self.numel, self.size)
        return chunk * base + min(chunk, extra), base + (1 if chunk < extra else 0)

    def segment_bounds(self, chunk: int, segment: int) -> tuple[int, int]:
        """(start, length) of one segment of a chunk in the flat tensor; length may be 0."""
        start, length = self.chunk_bounds(chunk)
        lo = min(segment * self.segment_numel, length)
        hi = min(lo + self.segment_numel, length)
        return start + lo, hi - lo

    # [Note: one index rule for both phases]
    # Number the 2(N-1) steps j = 0 .. 2N-3 (reduce-scatter first). At step j rank r sends chunk (r - j) mod N
    # and receives chunk (r - j - 1) mod N, in both phases. So the chunk a rank sends at step j+1 is exactly
    # the chunk it received (and, in the first phase, reduced) at step j.
    def send_chunk(self, rank: int, step: int) -> int:
        return (rank - step) % self.size

    def recv_chunk(self, rank: int, step: int) -> int:
        return (rank - step - 1) % self.size

    def is_reduce_step(self, step: int) -> bool:
        return step < self.size - 1


def batches_steps(tensor: torch.Tensor) -> bool:
    """Whether the ring takes one batched exchange per step for `tensor` (on a device: see `_run_batched`) rather than
    the pipelined walk of independent messages (host tensors through gloo)."""
    return tensor.device.type != "cpu"


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                    in_flight: int = DEFAULT_IN_FLIGHT, batched: bool | None = None) -> torch.Tensor:
    """All-reduce `tensor` in place over `group` (default: the world) with our ring; returns it.

    Every rank must call it with a tensor of the same shape and dtype. The result equals
    `dist.all_reduce(tensor, op, group)` exactly for integer dtypes and up to floating-point rounding
    (the summation order differs) for floating dtypes. A non-contiguous tensor is reduced through a
    contiguous copy that is written back. A group of one rank and an empty tensor are no-ops.

    `segment_bytes` bounds one message; `in_flight` is how many receives run ahead of the reduction.
    `batched` (default: `batches_steps(tensor)`, True on a device) takes one `batch_isend_irecv` per step instead.
    """
    if segment_bytes < 1 or in_flight < 1:
        raise ValueError(f"ring_all_reduce: segment_bytes={segment_bytes} and in_flight={in_flight} must "
                         f"both be >= 1 (defaults: {DEFAULT_SEGMENT_BYTES}, {DEFAULT_IN_FLIGHT})")
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("ring_all_reduce: this process is not a member of `group`; only the group's "
                         "ranks may call it (check the ranks passed to dist.new_group)")
    reduce = _reducer(op, tensor.dtype)
    if size == 1 or tensor.numel() == 0:
        return tensor
    # flat: [numel], sharing memory with `tensor` when it is contiguous.
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    plan = RingPlan(flat.numel(), size, max(1, segment_bytes // flat.element_size()))

    def to_global(group_rank: int) -> int:
        return group_rank if group is None else dist.get_global_rank(group, group_rank)

    right, left = to_global((rank + 1) % size), to_global((rank - 1) % size)
    with torch.no_grad():   # in-place adds on a parameter or a leaf that requires grad, like dist.all_reduce
        if batches_steps(tensor) if batched is None else batched:
            _run_batched(flat, plan, rank, right, left, group, reduce)
        else:
            _run(flat, plan, rank, right, left, group, reduce, in_flight)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    return tensor


def _run(flat: torch.Tensor, plan: RingPlan, rank: int, right: int, left: int,
         group: dist.ProcessGroup | None, reduce: Reducer, in_flight: int) -> None:
    """The pipelined walk, for host tensors through gloo. `right`/`left` are the global ranks this rank sends
    to / receives from.

    [Note: pipelining]
    Each chunk is cut into S segments of at most `segment_bytes`. The unit of work is a position
    p = j * S + k (step j, segment k). Segment k of step j+1 is sent as soon as segment k of step j has
    arrived and been reduced, so the ring is a pipeline across steps as well as within one: while this
    rank adds segment k, segment k+1 is on the wire and its own segment k is already travelling on.
    Receives are posted `in_flight` positions ahead of the one being reduced (gloo only sends once the
    receiver has posted, so this is the flow control); each position has its own tag (= p).
    Reduce-scatter receives land in `in_flight + 1` scratch rows, so the next receive is posted before
    the current segment is added out of its row. All-gather receives land straight in their place.
    """
    segs = plan.num_segments
    total = plan.num_steps * segs
    ahead = min(in_flight, total)
    # scratch: [ahead + 1, segment]: reduce-scatter position q lands in row q % (ahead + 1), so the
    # receive `ahead` positions on can be posted before position p is reduced out of its own row.
    # Only the (N-1) * S reduce-scatter positions use it: when they are fewer, row q % rows == q.
    rows = ahead + 1
    scratch = torch.empty((min(rows, (plan.size - 1) * segs), min(plan.segment_numel, plan.chunk_bounds(0)[1])),
                          dtype=flat.dtype, device=flat.device)
    recvs: dict[int, dist.Work | None] = {}
    sends: list[dist.Work | None] = []

    def post_recv(q: int) -> None:
        step, seg = divmod(q, segs)
        start, length = plan.segment_bounds(plan.recv_chunk(rank, step), seg)
        if length:   # reduce-scatter: into scratch, then added; all-gather: straight into place
            target = scratch[q % rows, :length] if plan.is_reduce_step(step) else flat[start:start + length]
            recvs[q] = dist.irecv(target, src=left, group=group, tag=q)

    def post_send(q: int) -> None:
        step, seg = divmod(q, segs)
        start, length = plan.segment_bounds(plan.send_chunk(rank, step), seg)
        if length:
            sends.append(dist.isend(flat[start:start + length], dst=right, group=group, tag=q))

    for q in range(ahead):
        post_recv(q)
    # Step 0 sends this rank's own data; they are posted `ahead + 1` segments ahead of the reduction
    # (the peer posts its receives no further ahead, so earlier sends would only queue).
    for q in range(min(rows, segs)):
        post_send(q)
    for p in range(total):
        step, seg = divmod(p, segs)
        work = recvs.pop(p, None)
        if work is not None:
            work.wait()
        if p + ahead < total:
            post_recv(p + ahead)
        if step == 0 and seg + rows < segs:
            post_send(seg + rows)
        if work is not None and plan.is_reduce_step(step):
            start, length = plan.segment_bounds(plan.recv_chunk(rank, step), seg)
            reduce(flat[start:start + length], scratch[p % rows, :length])
        if step + 1 < plan.num_steps:   # this segment is final for this step: pass it on
            post_send(p + segs)
    for work in sends:
        if work is not None:
            work.wait()


def _run_batched(flat: torch.Tensor, plan: RingPlan, rank: int, right: int, left: int,
                 group: dist.ProcessGroup | None, reduce: Reducer) -> None:
    """One `batch_isend_irecv([send right, recv left])` per step, whole chunks.

    [Note: device tensors: one batched exchange per step]
    The pipelined walk (`_run`) suits gloo, where every isend/irecv is an independent message. NCCL is different:
    point-to-point calls outside a batch are each a blocking rendezvous on one stream per peer pair, so the walk
    (several receives posted before the first send) deadlocks at 2 ranks, and at 3+ the lazily created
    communicator with the left neighbour waits on a rank that is itself waiting. So a tensor on a device takes
    this path: at each step j ONE `batch_isend_irecv([send chunk (r - j) to the right, receive chunk
    (r - j - 1) from the left])`, one NCCL group launch in which every rank's send and receive progress together,
    then (reduce-scatter steps) the add. Every rank of the group makes every step's call, also where its chunks
    are empty (a tensor of fewer elements than ranks): NCCL requires every rank in the first batched call.
    `wait()` on NCCL only makes the current stream wait, so the host does not block; the caller runs it on the thread that owns the device (not a worker thread, whose current CUDA device is 0),
    under `torch.cuda.device(tensor.device)`. gloo runs the same batched walk too (tests check it there).
    """
    # scratch: [largest chunk], the incoming chunk of a reduce-scatter step before it is added.
    scratch = torch.empty(plan.chunk_bounds(0)[1], dtype=flat.dtype, device=flat.device)
    for step in range(plan.num_steps):
        send_start, send_len = plan.chunk_bounds(plan.send_chunk(rank, step))
        recv_start, recv_len = plan.chunk_bounds(plan.recv_chunk(rank, step))
        reducing = plan.is_reduce_step(step)
        target = scratch[:recv_len] if reducing else flat[recv_start:recv_start + recv_len]
        # Both operations on every rank at every step, empty ones included: NCCL builds the communicator in the
        # first batched call, which every rank of the group must make (a rank that skipped it would leave the
        # others waiting there), and a zero-byte send and receive still pair up. The right neighbour receives
        # exactly the chunk this rank sends (same index, same length), so an empty send meets an empty receive.
        ops = [dist.P2POp(dist.isend, flat[send_start:send_start + send_len], right, group, tag=step),
               dist.P2POp(dist.irecv, target, left, group, tag=step)]
        for work in dist.batch_isend_irecv(ops):
            if work is not None:
                work.wait()
        if reducing and recv_len:
            reduce(flat[recv_start:recv_start + recv_len], target)
