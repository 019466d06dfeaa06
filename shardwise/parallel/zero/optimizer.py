"""ZeRO-1/2 optimizer step: each rank updates only its shard of every bucket, then all-gathers parameters.

Per bucket b, rank r holds a master of its shard: `masters[b]` [S_b]. In fp32 it is a Parameter that views
the shard of the bucket's own parameter buffer (no copy: the optimizer updates the model's storage); under
bf16/fp16 it is a separate fp32 tensor (ZeRO's K*psi/N includes these masters). The step:

    master.grad = grad_shard.float() (/ loss scale)   overflow flag and squared norm all-reduced over dp
    clip by the global norm; optimizer.step() on the shards; shard -> model dtype; all-gather each bucket
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from shardwise.comm.collectives import Comm
from shardwise.parallel.zero.buckets import ZeroBucket
from shardwise.parallel.zero.fused import prefer_fused_adam
from shardwise.precision import LossScaler
from shardwise.replicated_optimizer import optimizer_state_bytes

if TYPE_CHECKING:
    from shardwise.parallel.tensor_parallel.grads import ShardedTensorParallelGrads


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
        else:                     # on the compute device, also for a stage-3 shard offloaded to the CPU
            device = getattr(b, "compute_device", None) or shard.device
            masters.append(torch.nn.Parameter(shard.to(device, torch.float32, copy=True) if separate else shard))
    out = [dict({k: v for k, v in g.items() if k != "params"},
                params=[m for b, m in zip(buckets, masters) if b.group == gi]) for gi, g in enumerate(groups)]
    return [g for g in out if g["params"]], masters


class ShardedOptimizer:
    checkpoint_per_rank = True      # each rank saves its own optimizer shard

    def __init__(self, optimizer: torch.optim.Optimizer, *, buckets: list[ZeroBucket],
                 masters: list[torch.nn.Parameter], separate_masters: bool, comm: Comm, flags_comm: Comm,
                 scaler: LossScaler, clip: float, check_overflow: bool, gather_after_step: bool = True,
                 tp_grads: "ShardedTensorParallelGrads | None" = None):
        self.optimizer = optimizer
        # Under tensor parallelism the shards hold TP slices and replicated parameters: the norm and the
        # overflow verdict are completed over the TP group too (one 8-byte all-reduce each).
        self.tp_grads = tp_grads
        # ZeRO-3 (False): parameters stay sharded after the step; only separate masters are written back.
        self.gather_after_step = gather_after_step
        self.buckets = buckets
        self.masters = masters
        self.separate_masters = separate_masters
        self.comm = comm              # parameter all-gathers: gradient-step traffic, group "dp"
        self.flags_comm = flags_comm  # overflow flag and norm: a few bytes, group "dp:metrics"
        self.scaler = scaler
        self.clip = clip
        self.check_overflow = check_overflow
        self.last_grad_norm: float | None = None
        self.model_params = [p for b in buckets for p in b.params]
        # Offloaded masters get their gradients in host buffers kept across steps, page-locked like the masters
        # (a fresh empty_like each step would be pageable: its non_blocking copy would run synchronously).
        self._host_grads: list[torch.Tensor | None] = [None] * len(masters)
        # Before the host reads those gradients or writes the masters and offloaded shards, the device must be
        # done with every copy queued from or to them: one stream sync per step when any master is off-device.
        self._sync_host = any(m.device != b.grad_shard.device and b.grad_shard.is_cuda
                              for b, m in zip(buckets, masters))
        prefer_fused_adam(optimizer)      # one flat fp32 shard per bucket: the fused kernel's best case

    def step(self) -> bool:
        for i, (b, m) in enumerate(zip(self.buckets, self.masters)):
            g = b.grad_shard
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
        if self._sync_host:
            torch.cuda.current_stream().synchronize()
        grads = [m.grad for m in self.masters]
        if self.check_overflow:
            # One verdict for all buckets: a single device -> host read instead of one per bucket.
            local = bool(grads) and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
            overflow = self.flags_comm.all_reduce_object_max(float(local)) > 0
            if self.tp_grads is not None:
                overflow = self.tp_grads.any_overflow(overflow)
            if overflow:
                self.scaler.update(overflow=True)
                self.last_grad_norm = float("inf")
                return False
        scale = self.scaler.loss_scale
        if scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / scale)
        if self.clip > 0:
            if self.tp_grads is None:
                sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else None)
                for g in grads:           # float64 accumulation without a float64 copy of the bucket
                    sq += torch.linalg.vector_norm(g, dtype=torch.float64).square()
                self.flags_comm.all_reduce(sq)
                norm = math.sqrt(float(sq))
            else:                                  # [sliced, replicated] over dp, then slices over TP
                sq = self.tp_grads.local_squares(grads)
                self.flags_comm.all_reduce(sq)
                norm = self.tp_grads.global_norm(sq)
            self.last_grad_norm = norm
            coef = self.clip / (norm + 1e-6)       # torch.nn.utils.clip_grad_norm_'s rule
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        self._publish()
        self.scaler.update(overflow=False)
        return True

    @torch.no_grad()
    def _publish(self) -> None:
        """Make the updated masters the model's parameters: all-gathered (stages 1-2) or, for stage 3, only
        cast into this rank's shard (nothing to do when the masters are the shards themselves)."""
        if self.gather_after_step:
            self._gather_params()
        elif self.separate_masters:
            for b, m in zip(self.buckets, self.masters):
                b.param_shard.copy_(m)

    @torch.no_grad()
    def _gather_params(self) -> None:
        handles = []
        for b, m in zip(self.buckets, self.masters):
            # A separate send buffer: the input of all_gather must not alias its output.
            send = m.detach().to(device=b.param_flat.device, dtype=b.param_flat.dtype, non_blocking=True,
                                 copy=True)
            handles.append(self.comm.all_gather_into_tensor(b.param_flat, send, async_op=True))
        for h in handles:
            h.wait()

    def zero_master_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    def param_bytes(self) -> int:
        return sum(b.param_flat.numel() * b.param_flat.element_size() for b in self.buckets)

    def state_bytes(self) -> int:
        total = optimizer_state_bytes(self.optimizer)
        if self.separate_masters:
            total += sum(m.numel() * m.element_size() for m in self.masters)
        # the offloaded masters' host gradient buffers (kept across steps, as DeepSpeed keeps its CPU fp32 grads)
        total += sum(b.numel() * b.element_size() for b in self._host_grads if b is not None)
        return total

    @property
    def optimizer_device(self) -> str:
        return str(self.masters[0].device) if self.masters else "none"

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        if self.separate_masters:
            for b, m in zip(self.buckets, self.masters):
                m.copy_(b.param_shard)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                "masters": [m.detach().clone() for m in self.masters],
                "dp_rank": self.comm.rank, "dp_size": self.comm.size}

    @torch.no_grad()
    def load_state_dict(self, state: dict, *, load_optimizer_states: bool = True) -> None:
        if state["dp_size"] != self.comm.size:
            from shardwise.checkpoint import CheckpointError
            raise CheckpointError(f"this ZeRO checkpoint was written by {state['dp_size']} data-parallel ranks and "
                                  f"is being loaded by {self.comm.size}: resharding is not supported yet; load it "
                                  f"with {state['dp_size']} ranks")
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
        for m, saved in zip(self.masters, state["masters"]):
            m.copy_(saved)
        self._publish()
