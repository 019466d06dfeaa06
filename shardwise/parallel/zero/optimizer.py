"""ZeRO's update: each rank steps only its shard of every bucket, then (stages 1-2) all-gathers parameters.

Per bucket b, rank r holds a master of its shard: `masters[b]` [S_b]. In fp32 it is a Parameter that views
the shard of the bucket's own parameter buffer (no copy: the optimizer updates the model's storage); under
bf16/fp16 it is a separate fp32 tensor (ZeRO's K*psi/N includes these masters). The step:

    master.grad = grad_shard.float() (/ loss scale)   overflow flag and squared norm agreed by all ranks
    clip by the global norm; optimizer.step() on the shards; shard -> model dtype; all-gather each bucket

Stage 3 (`Stage3Update`) keeps unit shards sharded after the step (only separate masters are written back into
them) and all-gathers only its persistent buckets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardwise.comm.collectives import Comm
from shardwise.errors import CheckpointError
from shardwise.parallel.grad_norm import GradNormReducer
from shardwise.parallel.tied import TiedSlot
from shardwise.parallel.update import Piece, Update, UpdateRecipe
from shardwise.parallel.zero.buckets import ZeroBucket
from shardwise.parallel.zero.copies import CopyStream, HostGrad, pinned_like, wait_host
from shardwise.parallel.zero.fused import prefer_fused_adam
from shardwise.parallel.zero.flat import FlatShard
from shardwise.parallel.zero.stage3 import ZeroParamRuntime

if TYPE_CHECKING:
    from shardwise.parallel.grad_norm import ExtraSums

OFFLOADED_ATTR = "_shardwise_offloaded_master"
"""Set on a master that offload_optimizer keeps on the host (`make_shard_masters`)."""


def make_shard_masters(buckets: list[ZeroBucket], groups: list[dict], *, separate: bool,
                       offload_device: torch.device | None = None, pin_memory: bool = False
                       ) -> tuple[list[dict], list[torch.nn.Parameter]]:
    """One master Parameter per bucket; optimizer param groups keep the user's per-group options.
    With `offload_device` (ZeRO-Offload) the masters, hence the optimizer states built on them, live there
    (pinned when asked and CUDA is present, so device<->host copies can be asynchronous)."""
    masters = []
    for b in buckets:
        shard = b.param_shard.detach()
        if offload_device is not None:
            host = torch.empty(shard.shape, dtype=torch.float32, device=offload_device,
                               pin_memory=pin_memory and torch.cuda.is_available())
            masters.append(torch.nn.Parameter(host.copy_(shard)))
            setattr(masters[-1], OFFLOADED_ATTR, True)
        else:                     # on the compute device, also for a stage-3 shard offloaded to the CPU
            device = getattr(b, "compute_device", None) or shard.device
            masters.append(torch.nn.Parameter(shard.to(device, torch.float32, copy=True) if separate else shard))
    out = [dict({k: v for k, v in g.items() if k != "params"},
                params=[m for b, m in zip(buckets, masters) if b.group == gi]) for gi, g in enumerate(groups)]
    return [g for g in out if g["params"]], masters


def _event_after_copy(device: torch.device) -> object | None:
    """An event on the current stream after a copy queued there (None on the CPU, where it is done)."""
    if device.type != "cuda":
        return None
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    return done


class ShardedUpdate(Update):
    """Stages 1-2 (and, through `Stage3Update`, 3): one master per bucket shard, stepped by this rank only."""

    checkpoint_per_rank = True      # each rank saves its own optimizer shard

    def __init__(self, optimizer: torch.optim.Optimizer, *, buckets: list[ZeroBucket],
                 masters: list[torch.nn.Parameter], separate_masters: bool, comm: Comm, recipe: UpdateRecipe,
                 norms: GradNormReducer, gather_after_step: bool = True, tied: tuple[TiedSlot, ...] = ()):
        super().__init__(optimizer, stepped=masters, masters=masters, separate_masters=separate_masters,
                         recipe=recipe, norms=norms, tied=tied)
        # ZeRO-3 (False): parameters stay sharded after the step; only separate masters are written back.
        self.gather_after_step = gather_after_step
        self.buckets = buckets
        self.comm = comm              # parameter all-gathers: gradient-step traffic, group "dp"
        self.model_params = [p for b in buckets for p in b.params]
        self._where = {id(p): (k, i) for k, b in enumerate(buckets) for i, p in enumerate(b.params)}
        # Offloaded masters get their gradients in host buffers kept across steps, page-locked like the masters
        # (a fresh empty_like each step would be pageable: its non_blocking copy would run synchronously).
        self._host_grads: list[torch.Tensor | None] = [None] * len(masters)
        # Before the host reads those gradients or writes the masters and offloaded shards, the device must be
        # done with every copy queued from or to them: one stream sync per step when any master is off-device.
        self._sync_host = any(m.device != b.grad_shard.device and b.grad_shard.is_cuda
                              for b, m in zip(buckets, masters))
        # Offloaded masters: each bucket's (stage 3: also each unit flat's) gradient shard is sent to a pinned host
        # buffer of the model dtype as soon as it is final on the boundary's backward (`copies.py`; by the reducer,
        # or the stage-3 runtime: `_send_final_grads`); the host casts it. The updated master is cast on the host
        # into a pinned buffer of the model dtype before its host-to-device copy (`_host_to_device`).
        self._host_lp: list[torch.Tensor | None] = [None] * len(masters)
        self._h2d_events: list = [None] * len(masters)
        self._copies = None
        self._sent: list[HostGrad | None] = [None] * len(masters)
        # (Marked by make_shard_masters: the masters were put on the host by offload_optimizer; on a CPU-only run
        # that is the compute device itself, and these paths run with synchronous copies.)
        if any(getattr(m, OFFLOADED_ATTR, False) for m in masters):
            self._copies = CopyStream(buckets[0].grad_shard.device)
            self._sent = [HostGrad(b.grad_shard, self._copies) if getattr(m, OFFLOADED_ATTR, False) else None
                          for b, m in zip(buckets, masters)]
            self._send_final_grads()
        prefer_fused_adam(optimizer)      # one flat fp32 shard per bucket: the fused kernel's best case

    def _send_final_grads(self) -> None:
        """Who sends each shard's final gradient to its `HostGrad`: stages 1-2, the reducer (`bucket.host`)."""
        for b, host in zip(self.buckets, self._sent):
            b.host = host

    def _load_grads(self) -> None:
        queued = [h is not None and h.pending for h in self._sent]
        for i, (b, m) in enumerate(zip(self.buckets, self.masters)):
            g = b.grad_shard
            if queued[i]:                 # sent during backward: wait for this bucket's copy, cast on the host
                host = self._sent[i]
                assert host is not None   # queued: it has a HostGrad with a send pending
                sent = host.receive()
                buf = self._host_grads[i]
                if buf is None:
                    buf = self._host_grads[i] = pinned_like(m, dtype=m.dtype, pin=m.is_pinned())
                m.grad = buf.copy_(sent)      # [S] model dtype -> fp32, on the host
                continue
            if g.dtype == m.dtype and g.device == m.device:
                m.grad = g                # fp32 on the master's device: the shard itself, no copy (zeroed after step)
                continue
            if g.device == m.device:      # a cast on the device: a transient [S] fp32, freed after the step
                m.grad = g.to(m.dtype)
                continue
            buf = self._host_grads[i]
            if buf is None:
                buf = self._host_grads[i] = torch.empty(m.shape, dtype=m.dtype, device=m.device,
                                                        pin_memory=m.is_pinned())
            # Offloaded masters: device -> pinned host copies queue up without blocking; one sync below.
            m.grad = buf.copy_(g, non_blocking=True)
        if self._sync_host and not all(q for q, b, m in zip(queued, self.buckets, self.masters)
                                       if m.device != b.grad_shard.device):
            torch.cuda.current_stream().synchronize()

    @torch.no_grad()
    def _publish(self) -> None:
        """Make the updated masters the model's parameters: all-gathered (stages 1-2) or, for stage 3, only
        cast into this rank's shard (nothing to do when the masters are the shards themselves)."""
        if self.gather_after_step:
            self._gather_params()
        elif self.separate_masters:
            for i, (b, m) in enumerate(zip(self.buckets, self.masters)):
                if getattr(m, OFFLOADED_ATTR, False) and getattr(b, "compute_device", None) is None:
                    # an offloaded master into a shard on the device: cast on the host, half the bytes cross
                    b.param_shard.copy_(self._host_to_device(i, b, m))
                else:                     # on one device (or into a shard offload_param keeps on the host)
                    b.param_shard.copy_(m)

    @torch.no_grad()
    def _gather_params(self) -> None:
        handles = []
        for i, (b, m) in enumerate(zip(self.buckets, self.masters)):
            if self._copies is not None:
                send = self._host_to_device(i, b, m)
            else:
                # A separate send buffer: the input of all_gather must not alias its output.
                send = m.detach().to(device=b.param_flat.device, dtype=b.param_flat.dtype, non_blocking=True,
                                     copy=True)
            comm = b.comm if b.comm is not None else self.comm
            handles.append(comm.all_gather_into_tensor(b.param_flat, send, async_op=True))
        for h in handles:
            h.wait()

    def _host_to_device(self, i: int, b: ZeroBucket, m: torch.Tensor) -> torch.Tensor:
        """The offloaded master i in the model dtype on the device: cast on the host into a pinned buffer (whose
        previous copy must be done first), then one asynchronous copy of half the bytes."""
        shard = b.param_shard                          # [S] model dtype, on the device (a bucket's or a unit's)
        lp = self._host_lp[i]
        if lp is None:
            lp = self._host_lp[i] = pinned_like(m, dtype=shard.dtype)
        wait_host(self._h2d_events[i])
        lp.copy_(m.detach())                           # [S] fp32 -> model dtype, on the host
        send = lp.to(shard.device, non_blocking=True, copy=True)
        self._h2d_events[i] = _event_after_copy(shard.device)     # guards lp until the copy is done
        return send

    def param_bytes(self) -> int:
        return sum(b.param_flat.numel() * b.param_flat.element_size() for b in self.buckets)

    def state_bytes(self) -> int:
        # the offloaded masters' host gradient buffers (kept across steps, as DeepSpeed keeps its CPU fp32 grads)
        return super().state_bytes() + sum(b.numel() * b.element_size() for b in self._host_grads if b is not None)

    def staging_bytes(self) -> int:
        """Pinned host buffers of offload's copies, allocated once: the gradient shards sent during backward
        (model dtype) and the masters cast for their host-to-device copy (not for shards kept on the host)."""
        sent = sum(h.nbytes for h in self._sent if h is not None)
        return sent + sum(t.numel() * t.element_size() for t in self._host_lp if t is not None)

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        if self.separate_masters:
            for b, m in zip(self.buckets, self.masters):
                m.copy_(b.param_shard)

    def state_dict(self) -> dict:
        return dict(super().state_dict(), dp_rank=self.comm.rank, dp_size=self.comm.size)

    def pieces(self) -> list[list[Piece]]:
        """Master k holds the parts of bucket k's parameters that fall in this rank's shard."""
        return [[Piece(b.params[i], tuple(b.shapes[i]), lo, hi, dst) for i, lo, hi, dst in
                 b.layout.pieces_in_shard(b.rank)] for b in self.buckets]

    def full_master(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The whole fp32 master of `param`, assembled from every rank's shard. Collective over dp."""
        k, i = self._where[id(param)]
        return self._assemble(self.buckets[k], i, self.masters[k].detach())

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The whole averaged gradient of `param` (fp32), from every rank's gradient shard: valid after the
        boundary's backward and before step(). Collective over dp."""
        k, i = self._where[id(param)]
        return self._assemble(self.buckets[k], i, self.buckets[k].grad_shard)

    def full_shape(self, param: torch.nn.Parameter) -> tuple[int, ...]:
        k, i = self._where[id(param)]
        return tuple(self.buckets[k].shapes[i])

    def stepped_grads(self) -> list[torch.Tensor | None]:
        """Bucket k's gradient shard [S] (model dtype), laid out as master k."""
        return [b.grad_shard for b in self.buckets]

    def sum_over_shards(self, t: torch.Tensor, param: torch.nn.Parameter) -> None:
        bucket = self.buckets[self._where[id(param)][0]]
        (bucket.comm if bucket.comm is not None else self.comm).all_reduce(t)

    @torch.no_grad()
    def _assemble(self, bucket: ZeroBucket, i: int, shard: torch.Tensor) -> torch.Tensor:
        """Parameter i of `bucket` from per-rank shards: each rank writes its pieces into zeros, one sum."""
        device = getattr(bucket, "compute_device", None) or bucket.grad_shard.device
        out = torch.zeros(bucket.layout.sizes[i], dtype=torch.float32, device=device)
        for j, lo, hi, dst in bucket.layout.pieces_in_shard(bucket.rank):
            if j == i:
                out[lo:hi] = shard[dst:dst + hi - lo]
        (bucket.comm if bucket.comm is not None else self.comm).all_reduce(out)
        return out.view(bucket.shapes[i])

    @torch.no_grad()
    def state_dict_mismatch(self, state: dict) -> str | None:
        if state.get("dp_size") != self.comm.size:
            return (f"this ZeRO optimizer shard was written by {state.get('dp_size')} data-parallel ranks "
                    f"and is being loaded by {self.comm.size}: load it with {state.get('dp_size')} ranks, "
                    f"or through engine.load_checkpoint, which reshards")
        if state.get("zero_stage", 2) == 3:
            return ("this optimizer shard was written at ZeRO stage 3, whose shards are laid out by unit: load it "
                    "at stage 3, or through engine.load_checkpoint, which reshards")
        return None

    def load_state_dict(self, state: dict, *, load_optimizer_states: bool = True) -> None:
        mismatch = self.state_dict_mismatch(state)
        if mismatch is not None:
            raise CheckpointError(mismatch)
        self._load_common(state, load_optimizer_states)
        self._publish()


class Stage3Update(ShardedUpdate):
    """`ShardedUpdate` over unit shards (which stay sharded: no all-gather after the step) and persistent
    buckets (all-gathered after the step, as in ZeRO-2)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, runtime: ZeroParamRuntime, flats: list[FlatShard],
                 persistent: list[ZeroBucket], masters: list[torch.nn.Parameter], separate_masters: bool,
                 comm: Comm, recipe: UpdateRecipe, norms: GradNormReducer):
        self.runtime = runtime        # before the base class's init, which hands the runtime the host copies
        self.flats = flats
        self.persistent = persistent
        super().__init__(optimizer, buckets=[*flats, *persistent], masters=masters,  # type: ignore[list-item]
                         separate_masters=separate_masters, comm=comm, recipe=recipe, norms=norms,
                         gather_after_step=False)

    def _send_final_grads(self) -> None:
        """Stage 3: the runtime sends each unit flat's, the persistent reducer each persistent bucket's."""
        n = len(self.flats)
        for f, host in zip(self.buckets[:n], self._sent[:n]):
            if host is not None:
                self.runtime.send_final_grads(f, host)      # type: ignore[arg-type]
        for b, host in zip(self.buckets[n:], self._sent[n:]):
            b.host = host

    @torch.no_grad()
    def _publish(self) -> None:
        # The step's host reads waited for the gradient copies only, not for the gathers' host-to-device copies
        # of offloaded shards, which the separate masters are about to overwrite.
        self.runtime.wait_shard_reads()
        super()._publish()

    def step(self, extra: ExtraSums | None = None) -> bool:
        applied = super().step(extra)
        if applied:
            self._gather_persistent()
        return applied

    @torch.no_grad()
    def _gather_persistent(self) -> None:
        # A separate send buffer: the input of all_gather must not alias its output. Each bucket over its own
        # replica group (persistent experts: their expert-dp group), as the buckets were sharded.
        handles = [(b.comm if b.comm is not None else self.comm).all_gather_into_tensor(
                       b.param_flat, b.param_shard.clone(), async_op=True)
                   for b in self.persistent]
        for h in handles:
            h.wait()

    def param_bytes(self) -> int:
        """Unit shards plus persistent parameters (whole), not the transient gathered buffers."""
        shards = sum(f.shard.numel() * f.shard.element_size() for f in self.runtime.partition.flats)
        whole = sum(p.numel() * p.element_size() for p in self.runtime.partition.persistent)
        return shards + whole

    def _layout(self) -> list[int]:
        return [b.layout.numel for b in self.buckets]

    def state_dict(self) -> dict:
        return dict(super().state_dict(), zero_stage=3, flat_numels=self._layout())

    @torch.no_grad()
    def state_dict_mismatch(self, state: dict) -> str | None:
        if state.get("zero_stage") != 3 or state.get("flat_numels") != self._layout():
            return (f"this optimizer shard (ZeRO stage {state.get('zero_stage', '1 or 2')}) does not match this "
                    f"ZeRO-3 model's layout: load it with the same model, zero_optimization.stage, "
                    f"stage3_param_persistence_threshold and param groups it was saved with")
        if state.get("dp_size") != self.comm.size:
            return super().state_dict_mismatch(state)
        return None

    def load_state_dict(self, state: dict, *, load_optimizer_states: bool = True) -> None:
        super().load_state_dict(state, load_optimizer_states=load_optimizer_states)
        self._gather_persistent()

    def _after_load(self) -> None:
        super()._after_load()
        self._gather_persistent()

    def sync_masters_from_model(self) -> None:
        if self.runtime.loaded_placeholders:
            raise CheckpointError("load_module_only=True with a ZeRO-3 checkpoint: its module states hold empty "
                                  "placeholders (the weights are in the per-rank optimizer files); load it with "
                                  "load_module_only=False, or load a full state dict into the model")
        super().sync_masters_from_model()
