"""`FlatShard`: one flat buffer of a ZeRO-3 unit (one key: optimizer param group, dtype), sharded over the dp
group; its gather, free, offload and the views its parameters take. Units and their planning are in `params.py`,
where each parameter sits in the buffer in the layout (`partition.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.comm.collectives import Comm, Handle
from shardwise.parallel.replicas import ReplicaGroup
from shardwise.parallel.zero.copies import CopyStream, wait_stream
from shardwise.parallel.zero.partition import FlatLayout, RowLayout
from shardwise.parallel.zero.states import REDUCE_MOVES, ReduceState, advance


@dataclass(frozen=True)
class FlatKey:
    group: int | None          # optimizer param-group index; None: not optimized (frozen or not passed)
    dtype: torch.dtype
    replicas: ReplicaGroup | None = None    # the parameters' own replica group (experts'); None: the dp group


def _resize(t: torch.Tensor, numel: int) -> None:
    storage = t.untyped_storage()
    if storage.nbytes() != numel * t.element_size():
        storage.resize_(numel * t.element_size())


@dataclass(eq=False)
class FlatShard:
    """One padded flat buffer of a unit (one key), sharded over the dp group:

        shard      [S]        model dtype   this rank's part, S = padded // dp: the only copy kept between uses
        full       [padded]   model dtype   gathered buffer, padded = dp * S: allocated at the first gather, its
                                            storage resized to 0 bytes while the unit is sharded
        param.data full[off : off + numel].view(shape) while gathered; while sharded an empty [0] placeholder
                   (the engine) or a view of its piece of the shard (`params_view_shard`: the module wrappers)

    Freeing resizes the buffer's storage to 0 bytes rather than dropping it: autograd may have saved a view of a
    weight during forward (F.linear saves `weight.t()`), and that view keeps pointing at the same storage, which
    holds the right values again once the unit is gathered again for backward, and no memory in between.

    It has the members `ShardedUpdate` reads of a `ZeroBucket` (`group`, `params`, `param_shard`, `grad_shard`,
    `layout`), so the update steps unit shards as it steps buckets."""

    unit: int
    key: FlatKey
    params: list[nn.Parameter]
    shapes: list[torch.Size]
    layout: FlatLayout | RowLayout
    rank: int
    shard: torch.Tensor                  # [S]
    full: torch.Tensor | None            # [padded], allocated at the first gather; 0 bytes while free
    views: list[torch.Tensor]            # views[i] = full[off_i : off_i + n_i].view(shapes[i])
    empty: torch.Tensor                  # [0] placeholder every parameter points at while free
    grad_shard: torch.Tensor | None      # [S] averaged gradient, summed over micro-batches (optimized keys)
    pieces: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # i -> (lo, hi, start in shard)
    # backward bookkeeping, owned by stage3.ZeroParamRuntime
    grad_full: torch.Tensor | None = None     # [padded] this micro-batch's gradients, while being reduced
    ready: int = 0                            # parameters whose gradient arrived in this backward
    reduce_state: ReduceState = ReduceState.COLLECTING
    received: torch.Tensor | None = None      # [S] reduce-scatter output
    handle: Handle | None = None
    # ZeRO-Offload of parameters: the shard lives on the CPU between uses and is copied to this device
    # (non-blocking from pinned memory) for each all-gather. None: the shard's own device.
    compute_device: torch.device | None = None
    # Mixed precision with the shard as the master (the module wrappers): the shard keeps key.dtype (fp32), the
    # gathered buffer is compute_dtype (bf16), gradients are reduced in reduce_dtype. None: key.dtype.
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    # The module wrappers: while free, parameter i views its piece of the shard, shaped layout.local_shape (its
    # dim-0 rows under RowLayout), and its .grad the same piece of grad_shard, so an optimizer built on the
    # module's parameters steps the shard in place.
    params_view_shard: bool = False
    # grad_shard got its first reduction: from then on the free parameters show their pieces of it as .grad
    # (before, they have none, as on one process before the first backward)
    has_grads: bool = False
    # The key's replica group (`parallel/replicas.py`: experts' expert-dp group), over which this flat is sharded,
    # gathered and reduce-scattered; None: the dp group. Gradients still divide by the dp size.
    comm: Comm | None = None

    @classmethod
    def allocate(cls, unit: int, key: FlatKey, params: list[nn.Parameter], shapes: list[torch.Size], *,
                 dp_size: int, rank: int, device: torch.device, grad_shard: bool = True,
                 layout_type: type[FlatLayout] | type[RowLayout] = FlatLayout,
                 shard_dims: tuple[int, ...] = ()) -> "FlatShard":
        """A zeroed shard (and, for an optimized key when `grad_shard`, a zeroed gradient shard). `shard_dims`: per
        parameter, the dim a `RowLayout` cuts it along (empty: dim 0)."""
        layout = RowLayout.of_shapes(shapes, dp_size, shard_dims) if layout_type is RowLayout \
            else layout_type.of_shapes(shapes, dp_size)
        shard = torch.zeros(layout.shard_numel, dtype=key.dtype, device=device)
        flat = cls(unit, key, params, list(shapes), layout, rank, shard, None, [],
                   torch.empty(0, dtype=key.dtype, device=device),
                   torch.zeros_like(shard) if key.group is not None and grad_shard else None)
        flat.pieces = {i: (lo, hi, dst) for i, lo, hi, dst in layout.pieces_in_shard(rank)}
        return flat

    def move_reduce(self, to: ReduceState) -> None:
        self.reduce_state = advance(REDUCE_MOVES, self.reduce_state, to,
                                    f"ZeRO-3 flat of unit {self.unit} ({self.key.dtype}), its reduce state")

    @property
    def group(self) -> int | None:
        return self.key.group

    @property
    def param_shard(self) -> torch.Tensor:
        return self.shard

    @torch.no_grad()
    def copy_piece(self, i: int, value: torch.Tensor) -> None:
        """Copy this rank's piece of parameter i, given its full value (any shape), into the shard."""
        if i in self.pieces:
            lo, hi, dst = self.pieces[i]
            if isinstance(self.layout, RowLayout) and self.layout.dim(i):     # a slice along another dim
                local = self.layout.local_shape(i, self.rank)
                self.shard[dst:dst + hi - lo].view(local).copy_(self.layout.piece_of(i, self.rank, value))
                return
            self.shard[dst:dst + hi - lo].copy_(value.reshape(-1)[lo:hi])

    def local_views(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Per parameter, its piece of `t` (a tensor laid out like the shard), shaped `layout.local_shape` (its
        dim-0 rows under RowLayout; empty where this rank holds none of it)."""
        out = []
        for i in range(len(self.params)):
            lo, hi, dst = self.pieces.get(i, (0, 0, 0))
            out.append(t[dst:dst + hi - lo].view(self.layout.local_shape(i, self.rank)))
        return out

    def offload(self, device: torch.device, *, pin_memory: bool) -> None:
        """Keep the shard on `device` (the CPU) between uses; gathers still happen on the compute device."""
        self.compute_device = self.shard.device
        # One host copy, page-locked when asked (and CUDA exists), so the gathers' H2D copies can be asynchronous.
        host = torch.empty(self.shard.shape, dtype=self.shard.dtype, device=device,
                           pin_memory=pin_memory and torch.cuda.is_available())
        self.shard = host.copy_(self.shard)

    def launch_gather(self, comm: Comm, copies: CopyStream | None = None) -> Handle:
        """All-gather the unit's buffer. `FlatLayout` (the engine's: contiguous element ranges) gathers into `full`
        directly; `RowLayout` (the wrappers': each rank's dim-0 rows of every parameter) gathers into a transient
        rank-major [dp, S] buffer, and `layout.copy_out` moves it into `full` (parameter-major) in one split-copy.
        An offloaded shard is copied to the device and gathered on `copies`' side stream (after the work queued so
        far), so a prefetch overlaps the compute queued after it; waiting on the handle makes the current stream
        wait for both."""
        device = self.compute_device or self.shard.device
        dtype = self.compute_dtype or self.key.dtype
        if self.layout.gathers_in_place:
            return self._gather_into(self._fill_full(device, dtype), comm, copies, device, dtype)
        # rank-major [dp * S], transient: allocated on the compute stream, which alone reads it (copy_out); the
        # full buffer gets its memory only then, so a prefetch in flight holds one [padded] buffer, not two
        staged = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
        inner = self._gather_into(staged, comm, copies, device, dtype)

        def wait() -> None:
            inner.wait()
            self.layout.copy_out(staged, self._fill_full(device, dtype))

        return Handle(wait, lambda: None)

    def _fill_full(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Give the full buffer its memory back (the same storage, so saved views of weights stay valid); returns
        it."""
        if self.full is None:
            self.full = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
            self.views = [self.full[o:o + n].view(s)
                          for o, n, s in zip(self.layout.offsets, self.layout.sizes, self.shapes)]
        else:
            _resize(self.full, self.layout.padded_numel)
        return self.full

    def _gather_into(self, out: torch.Tensor, comm: Comm, copies: CopyStream | None, device: torch.device,
                     dtype: torch.dtype) -> Handle:
        send = self.shard
        if device == send.device and dtype == send.dtype:
            return comm.all_gather_into_tensor(out, send, async_op=True)
        if copies is None or copies.stream is None or device == send.device:
            # a transient [S] copy on the compute stream: a cast on the device, or H2D without a copy stream
            return comm.all_gather_into_tensor(out, send.to(device, dtype, non_blocking=True), async_op=True)
        with copies.stream_context():
            send = send.to(device, dtype, non_blocking=True)          # pinned host -> device, async
            inner = comm.all_gather_into_tensor(out, send, async_op=True)
            done = copies.join()

        def wait() -> None:
            inner.wait()
            wait_stream(done, device)         # also a world-1 local copy made on the side stream

        return Handle(wait, lambda: None)

    def attach(self) -> None:
        """The parameters view the gathered buffer."""
        if self.params_view_shard:
            self._take_back_grads()
        for p, v in zip(self.params, self.views):
            p.data = v

    def release(self) -> None:
        """The parameters back on their placeholders (or shard pieces); the buffer's storage to 0 bytes."""
        if self.params_view_shard:
            pieces, grads = self.shard_pieces()
            for p, v in zip(self.params, pieces):
                p.data = v
            if self.has_grads:
                for p, g in zip(self.params, grads):
                    p.grad = g
        else:
            for p in self.params:
                p.data = self.empty
        if self.full is not None:
            _resize(self.full, 0)

    def shard_pieces(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Per parameter: its piece of the shard (shaped `layout.local_shape`, empty when none is on this rank),
        and of grad_shard."""
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        if self.grad_shard is not None:
            grads = list(self.local_views(self.grad_shard))
        return self.local_views(self.shard), grads

    @torch.no_grad()
    def _take_back_grads(self) -> None:
        """Before a gather: what the user did to the shown gradients goes into grad_shard (a .grad set to None,
        optimizer.zero_grad's default, zeroes its piece; a replaced one is copied in); then .grad is cleared so
        that autograd accumulates this backward's full-shape gradient afresh."""
        if self.has_grads:
            assert self.grad_shard is not None      # has_grads: a reduction was added into grad_shard
            for p, g in zip(self.params, self.local_views(self.grad_shard)):
                if p.grad is None:
                    g.zero_()
                elif p.grad.data_ptr() != g.data_ptr() or p.grad.shape != g.shape:
                    g.copy_(p.grad)
        for p in self.params:
            p.grad = None
