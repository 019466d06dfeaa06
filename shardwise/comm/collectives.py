"""The one thin layer every collective goes through.

`Comm` binds a process group to a ledger. Strategy code never calls `torch.distributed` collectives
directly: it calls the `Comm` it was handed, so every byte moved is recorded with its group.
Asynchronous operations return a `Handle` whose `wait()` records the duration.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

from shardwise.comm.ledger import CommLedger

BROADCAST_BUCKET_BYTES = 250 * 2**20
"""The most a coalesced broadcast flattens at once (torch DDP's broadcast_bucket_size)."""

if TYPE_CHECKING:
    from shardwise.comm.shm import SharedBuffers

# torch 2.13 renamed the flat-tensor collectives (`*_single`) and made the old names warn FutureWarning on
# every call, i.e. once per rank per run. Same arguments, same semantics; older torch has only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


COLLECTIVES_AT_ONE_ENV = "SHARDWISE_COLLECTIVES_AT_WORLD_1"
"""Test-only: "1" makes a world of one process run every collective through its backend (a `Comm` of size 1 is
otherwise a no-op), so one GPU exercises NCCL's kernels and the ledger records what a larger world would."""


def collectives_at_world_one() -> bool:
    return os.environ.get(COLLECTIVES_AT_ONE_ENV, "") == "1"


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_T = TypeVar("_T")


class Waitable(Protocol):
    """What an asynchronous launch returns: torch's `Work`, or our own exchanges."""

    def wait(self) -> object: ...


class Handle:
    """Completion of one asynchronous operation; `wait()` is idempotent."""

    def __init__(self, wait_fn: Callable[[], object], on_done: Callable[[], None],
                 test_fn: Callable[[], bool] | None = None):
        self._wait_fn = wait_fn
        self._on_done = on_done
        self._test_fn = test_fn
        self._done = False

    def is_completed(self) -> bool:
        """Non-blocking: has the operation finished? (recorded, as by `wait`, once it has)."""
        if not self._done and self._test_fn is not None and self._test_fn():
            self.wait()
        return self._done

    def wait(self) -> None:
        if not self._done:
            self._wait_fn()
            self._on_done()
            self._done = True


class _Done(Handle):
    def __init__(self) -> None:
        super().__init__(lambda: None, lambda: None)


@dataclass
class Comm:
    """A process group plus the ledger that records what goes over it.

    `group=None` means the default (world) group. A Comm of size 1 performs no communication and
    records nothing, so single-process runs pay nothing (except under the test switch `force_collectives`).
    """

    group: dist.ProcessGroup | None
    ledger: CommLedger
    name: str = "world"
    force_collectives: bool = dataclasses.field(default_factory=lambda: collectives_at_world_one())
    """The test switch (`COLLECTIVES_AT_ONE_ENV`): run and record the collectives of a group of one too."""

    @property
    def local(self) -> bool:
        """Nothing to communicate: a group of one (unless the test switch asks for its collectives anyway)."""
        return self.size == 1 and not self.force_collectives

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    @functools.cached_property
    def backend(self) -> str:
        """The group's backend ("gloo", "nccl"), looked up once: the collectives below ask on every call."""
        return str(dist.get_backend(self.group))

    def global_rank(self, group_rank: int) -> int:
        """The world rank of this group's member `group_rank` (p2p ops take world ranks)."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _explained(self, fn: Callable[[], _T]) -> Callable[[], _T]:
        """`fn` whose backend failure (a timeout, a peer gone) is re-raised as the ledger's explanation."""
        def run() -> _T:
            try:
                return fn()
            except RuntimeError as e:
                explained = self.ledger.explain(e) if self.ledger.explain is not None else e
                if explained is e:
                    raise
                raise explained from e
        return run

    def _run(self, op: str, tensor: torch.Tensor, launch: Callable[[], Waitable | None], async_op: bool,
             payload: int | None = None, signature: str | None = None) -> Handle:
        dtype = str(tensor.dtype).removeprefix("torch.")
        token = self.ledger.start(op, self.name, signature or f"{dtype}{list(tensor.shape)}", device=tensor.device)
        size = self.size
        amount = nbytes(tensor) if payload is None else payload

        def on_done() -> None:
            self.ledger.finish(token, op=op, group=self.name, group_size=size, nbytes=amount, dtype=dtype)

        work = self._explained(launch)()
        completed = getattr(work, "is_completed", None)
        if completed is not None:      # NCCL's wait() returns at once: completion says whether it still waits
            self.ledger.watch(token, completed)
        handle = Handle(self._explained(work.wait) if work is not None else _nothing, on_done)
        if not async_op:
            handle.wait()
        return handle

    # -- collectives ------------------------------------------------------------------------------
    @functools.cached_property
    def carries_host_tensors(self) -> bool:
        """Whether the group has a CPU backend (gloo, or gloo beside NCCL): host tensors then go as they are."""
        from shardwise.comm.device import has_cpu_backend
        return has_cpu_backend(self.group)

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A device copy of a host tensor when the group has no CPU backend (NCCL alone), on this rank's current
        GPU (`shardwise.comm.device.select_device` set it). None: use `tensor` as it is."""
        if tensor.device.type != "cpu" or self.carries_host_tensors:
            return None
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = False) -> Handle:
        if self.local:
            return _Done()
        staged = self._staged(tensor)
        if staged is not None:          # synchronous: the result is copied back into the host tensor
            self._run("all_reduce", staged, lambda: dist.all_reduce(staged, op=op, group=self.group, async_op=True),
                      False)
            tensor.copy_(staged)
            return _Done()
        return self._run("all_reduce", tensor,
                         lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True), async_op)

    def ring_all_reduce(self, tensor: torch.Tensor, async_op: bool = False, *,
                        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Handle:
        """Our ring all-reduce (`shardwise.comm.ring`), in place, recorded as ONE ledger entry whose
        bytes are the tensor's (the ring's internal sends are not recorded separately).

        The ring runs in the calling thread and is complete when this returns, so the handle of
        `async_op=True` only records the entry on `wait()`; overlap comes from calling it on a
        communication thread."""
        if self.local:
            return _Done()
        from shardwise.comm.ring import ring_all_reduce

        def launch() -> None:
            ring_all_reduce(tensor, self.group, op=op)

        return self._run("ring_all_reduce", tensor, launch, async_op)

    def shm_all_reduce(self, shared: "SharedBuffers", index: int) -> Handle:
        """Our shared-memory all-reduce of `shared.local[index]` (`shardwise.comm.shm`), in place and blocking,
        recorded as ONE ledger entry of the buffer's bytes (its barriers are not recorded)."""
        if self.local:
            return _Done()
        return self._run("shm_all_reduce", shared.local[index], lambda: shared.all_reduce_(index), False)

    def broadcast(self, tensor: torch.Tensor, src_group_rank: int = 0, async_op: bool = False) -> Handle:
        if self.local:
            return _Done()
        src = self.global_rank(src_group_rank)
        staged = self._staged(tensor)
        if staged is not None:
            self._run("broadcast", staged, lambda: dist.broadcast(staged, src=src, group=self.group, async_op=True),
                      False)
            tensor.copy_(staged)
            return _Done()
        return self._run("broadcast", tensor,
                         lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True), async_op)

    @torch.no_grad()
    def broadcast_coalesced(self, tensors: Sequence[torch.Tensor], src_group_rank: int = 0,
                            bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
        """`src_group_rank`'s values of `tensors` on every rank, in place: one broadcast per bucket of one dtype and
        device (each tensor flattened into it [sum of numels] and copied back), not one per tensor; a BatchNorm
        network's hundreds of buffers would otherwise pay a collective's latency each. Buckets stop at
        `bucket_bytes` so the flat copy stays small beside a large model."""
        if self.local or not tensors:
            return
        groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
        filled: dict[tuple[torch.dtype, torch.device], int] = {}
        for t in tensors:
            key = (t.dtype, t.device)
            buckets = groups.setdefault(key, [[]])
            if buckets[-1] and filled[key] + t.nbytes > bucket_bytes:
                buckets.append([])
                filled[key] = 0
            buckets[-1].append(t)
            filled[key] = filled.get(key, 0) + t.nbytes
        for buckets in groups.values():
            for bucket in buckets:
                flat = torch.cat([t.detach().reshape(-1) for t in bucket])
                self.broadcast(flat, src_group_rank=src_group_rank)
                offset = 0
                for t in bucket:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def all_gather_into_tensor(self, output: torch.Tensor, shard: torch.Tensor,
                               async_op: bool = False) -> Handle:
        """output: [size * shard.numel()] gathered in group-rank order. Recorded bytes: the output."""
        if self.local:
            output.copy_(shard.reshape(output.shape))
            return _Done()
        return self._run("all_gather", output,
                         lambda: _all_gather_flat(output, shard, group=self.group, async_op=True),
                         async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, full: torch.Tensor,
                              op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False) -> Handle:
        """full: [size * output.numel()]; this rank receives the reduced chunk of its group rank.
        Recorded bytes: the input (the full tensor every rank contributes)."""
        if self.local:
            output.copy_(full.reshape(output.shape))
            return _Done()
        return self._run("reduce_scatter", full,
                         lambda: _reduce_scatter_flat(output, full, op=op, group=self.group,
                                                             async_op=True), async_op)

    def reduce_scatter_sum(self, output: torch.Tensor, full: torch.Tensor, *, tag: int,
                           async_op: bool = False) -> Handle:
        """`reduce_scatter_tensor` with SUM, by the cheaper means the backend has: on gloo with CPU tensors a
        pairwise exchange of point-to-point messages (`shardwise.comm.exchange`: gloo's own reduce-scatter is a
        full all-reduce), otherwise the backend's. Recorded as the same one "reduce_scatter" of `full`'s bytes.
        `tag` (the same on every rank) tells apart exchanges in flight on this group at once."""
        if self.size == 1 or full.device.type != "cpu" or self.backend != "gloo":
            return self.reduce_scatter_tensor(output, full, async_op=async_op)
        from shardwise.comm.exchange import PairwiseReduceScatter
        return self._run("reduce_scatter", full,
                         lambda: PairwiseReduceScatter(output, full, group=self.group, rank=self.rank,
                                                       size=self.size, tag=tag, to_global=self.global_rank),
                         async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, *,
                          output_splits: list[int] | None = None, input_splits: list[int] | None = None) -> Handle:
        """input, output: [size, ...] contiguous; output[j] receives group rank j's input[self.rank]. With splits:
        rows of input [sum(input_splits), ...] go in consecutive runs, run j to group rank j, and output
        [sum(output_splits), ...] receives run j from group rank j; the ledger's signature is then the dtype and the
        trailing shape only (the row counts differ between ranks, and the desync check compares signatures across
        ranks). Recorded bytes: the input."""
        if self.local:
            output.copy_(input)
            return _Done()
        if output_splits is None and input_splits is None:
            return self._run("all_to_all", input,
                             lambda: dist.all_to_all_single(output, input, group=self.group, async_op=True), async_op)
        dtype = str(input.dtype).removeprefix("torch.")
        return self._run("all_to_all", input,
                         lambda: dist.all_to_all_single(output, input, output_split_sizes=output_splits,
                                                        input_split_sizes=input_splits, group=self.group,
                                                        async_op=True),
                         async_op, signature=f"{dtype}[*, {list(input.shape[1:])}]")

    def all_reduce_object_max(self, value: float) -> float:
        """Max of one float over the group (e.g. an overflow flag): a 1-element all-reduce."""
        t = torch.tensor([float(value)], dtype=torch.float32)
        self.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every group rank's picklable `obj`, in group-rank order: for small, rare exchanges (a checkpoint's
        index, a load verdict), never per step."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        token = self.ledger.start("all_gather_object", self.name)
        dist.all_gather_object(out, obj, group=self.group)
        self.ledger.finish(token, op="all_gather_object", group=self.name, group_size=self.size, nbytes=0,
                           dtype="object")
        return out

    def barrier(self) -> None:
        if not self.local:
            token = self.ledger.start("barrier", self.name)
            self._explained(lambda: dist.barrier(group=self.group))()
            self.ledger.finish(token, op="barrier", group=self.name, group_size=self.size, nbytes=0,
                               dtype="none")

    # -- point to point (group ranks; recorded) -------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst_group_rank: int, tag: int = 0) -> Handle:
        dst = self.global_rank(dst_group_rank)
        return self._run("send", tensor, lambda: dist.isend(tensor, dst=dst, group=self.group, tag=tag), True)

    def irecv(self, tensor: torch.Tensor, src_group_rank: int, tag: int = 0) -> Handle:
        src = self.global_rank(src_group_rank)
        return self._run("recv", tensor, lambda: dist.irecv(tensor, src=src, group=self.group, tag=tag), True)

    def batch_isend_irecv(self, sends: Sequence[tuple[torch.Tensor, int]],
                          recvs: Sequence[tuple[torch.Tensor, int]]) -> list[Handle]:
        """Post sends and receives, each (tensor, peer group rank), as one `dist.batch_isend_irecv`: with NCCL
        one group launch whose operations progress together (a send and a receive between the same two ranks
        cannot wait on each other); gloo posts them one by one. Returns a handle per operation, sends first;
        each is recorded when it completes."""
        items = [("send", t, p) for t, p in sends] + [("recv", t, p) for t, p in recvs]
        if not items:
            return []
        ops = [dist.P2POp(dist.isend if op == "send" else dist.irecv, t, self.global_rank(p), group=self.group)
               for op, t, p in items]
        tokens = [self.ledger.start(op, self.name, f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}",
                                    device=t.device) for op, t, _ in items]
        works = [w for w in dist.batch_isend_irecv(ops) if w is not None]
        size = self.size
        handles = []
        for i, (op, t, _) in enumerate(items):
            # NCCL coalesces the batch into one work for all operations; gloo returns one per operation.
            mine = [works[i]] if len(works) == len(items) else works
            self.ledger.watch(tokens[i], functools.partial(_all_completed, mine))

            def on_done(token: int = tokens[i], op: str = op, amount: int = nbytes(t),
                        dtype: str = str(t.dtype).removeprefix("torch.")) -> None:
                self.ledger.finish(token, op=op, group=self.name, group_size=size, nbytes=amount, dtype=dtype)

            handles.append(Handle(self._explained(functools.partial(_wait_all, mine)), on_done,
                                  functools.partial(_all_completed, mine)))
        return handles


def _nothing() -> None:
    """The wait of an operation that completed when it was launched."""


def _wait_all(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def _all_completed(works: list[dist.Work]) -> bool:
    return all(w.is_completed() for w in works)
