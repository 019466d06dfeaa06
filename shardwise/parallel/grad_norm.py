"""The whole model's gradient norm and overflow verdict, agreed by every rank that holds a part of the model.

A rank steps some tensors: whole parameters (ZeRO stage 0) or flat shards of buckets (ZeRO 1-3). Their
elements are of two kinds:
- sliced: part of a tensor-parallel slice, different on every TP rank (every element, without TP);
- replicated: part of a parameter every TP rank holds whole (norm weights, row-parallel biases), whose
  gradient is equal on all TP ranks, so it must be counted once.
Other parts of this rank's TP slice sit on other ranks: the layers of the other pipeline stages, and under ZeRO
the other dp ranks' shards. Call those ranks the holders (pp ranks for stage 0, pp x dp ranks for ZeRO). Then

    ||g||^2 = sum over TP of (sum over holders of sliced ||g||^2)  +  sum over holders of replicated ||g||^2

Per step: one all-reduce of float64 [sliced, replicated] over the holders (16 bytes) and one of the sliced
part over TP (8 bytes). The overflow flag is the max over the same two groups, so every rank that holds part of
one model skips a step together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from torch import Tensor

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.parallel.tensor_parallel.layers import is_tensor_parallel_shard
from shardwise.topology import Axis, ParallelMesh

Ranges = tuple[tuple[int, int], ...]
"""Flat element ranges [a, b) of one stepped tensor that hold replicated elements."""


def whole_tensor_layout(params: Sequence[Tensor]) -> list[Ranges]:
    """Stage 0: each stepped tensor is one parameter, replicated across TP (all its elements) or a TP slice."""
    return [() if is_tensor_parallel_shard(p) else ((0, p.numel()),) for p in params]


def shard_layout(buckets: Sequence) -> list[Ranges]:
    """ZeRO: each stepped tensor is this rank's shard [S] of a flat bucket (`ZeroBucket` / `FlatShard`: `params`,
    `layout`, `rank`) that may mix TP slices and replicated parameters; the layout says where each lies."""
    return [tuple((dst, dst + hi - lo) for i, lo, hi, dst in b.layout.pieces_in_shard(b.rank)
                  if not is_tensor_parallel_shard(b.params[i]))
            for b in buckets]


@dataclass(frozen=True)
class GradNormReducer:
    """Built once from the mesh (`from_mesh`); each update strategy binds it to its stepped tensors
    (`for_tensors`). `clip_` and `overflow` are collective over the holders and the TP group."""

    stage_comm: Comm
    """The pipeline's stages ("pp:metrics"): the holders of a stage-0 slice."""
    model_comm: Comm
    """pp x dp ranks of one TP coordinate ("dp:metrics", "pp*dp:metrics" under a pipeline): ZeRO's holders."""
    tp_comm: Comm
    """The TP group ("tp:metrics"), over which sliced squares are summed."""
    layout: tuple[Ranges, ...] | None = None
    dp_sharded: bool = False
    uncounted: frozenset[int] = frozenset()
    """Stepped tensors left out of the norm: tied copies whose weight another holder counts."""

    @classmethod
    def from_mesh(cls, mesh: ParallelMesh, ledger: CommLedger) -> "GradNormReducer":
        pipelined = mesh.size(Axis.PP) > 1
        # Without a pipeline the dp group is the holders' group: no extra process group is needed for it.
        model = (mesh.comm_sharing_tp(ledger, name="pp*dp:metrics") if pipelined
                 else mesh.comm(Axis.DP, ledger, name="dp:metrics"))
        return cls(stage_comm=mesh.comm(Axis.PP, ledger, name="pp:metrics"), model_comm=model,
                   tp_comm=mesh.comm(Axis.TP, ledger, name="tp:metrics"))

    def for_tensors(self, layout: Sequence[Ranges], *, dp_sharded: bool,
                    uncounted: frozenset[int] = frozenset()) -> "GradNormReducer":
        """This reducer for one list of stepped tensors: `layout[i]` the replicated ranges of tensor i;
        `dp_sharded`: the dp ranks hold disjoint parts (ZeRO) rather than equal copies (stage 0); `uncounted`:
        indices of tensors another rank counts (tied copies)."""
        return replace(self, layout=tuple(layout), dp_sharded=dp_sharded, uncounted=frozenset(uncounted))

    @property
    def holders(self) -> Comm:
        return self.model_comm if self.dp_sharded else self.stage_comm

    @property
    def alone(self) -> bool:
        """No other rank holds a part of this rank's gradients."""
        return self.holders.size == 1 and self.tp_comm.size == 1 and not self.uncounted

    def overflow(self, local: bool) -> bool:
        """True on every rank if any holder or TP peer saw inf/nan (each checks only what it steps)."""
        if self.alone:
            return local
        flag = self.holders.all_reduce_object_max(float(local))
        return self.tp_comm.all_reduce_object_max(flag) > 0

    def clip_(self, params: Sequence[Tensor], max_norm: float) -> float:
        """Scale every `p.grad` by max_norm / (norm + 1e-6) when that is below 1 (torch's clip_grad_norm_ rule),
        with the whole model's norm; returns the norm."""
        if self.alone:      # torch's own arithmetic: bitwise the single-process reference
            return float(torch.nn.utils.clip_grad_norm_(list(params), max_norm))
        norm = self.norm(params)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
        return norm

    def total_norm(self, params: Sequence[Tensor]) -> float:
        """The whole model's norm of the `p.grad`s, without clipping (what clip_ would return)."""
        if self.alone:      # the arithmetic of clip_grad_norm_, which clip_ uses alone
            return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        return self.norm(params)

    def norm(self, params: Sequence[Tensor]) -> float:
        sq = self._local_squares(params)
        self.holders.all_reduce(sq)
        sliced = sq[:1].clone()
        self.tp_comm.all_reduce(sliced)
        return math.sqrt(max(float(sliced), 0.0) + float(sq[1]))

    def _local_squares(self, params: Sequence[Tensor]) -> Tensor:
        """float64 [2]: this rank's (sliced, replicated) sums of squares. All on the gradients' device, so the
        only host read is the final one."""
        layout = self.layout if self.layout is not None else ((),) * len(params)
        if len(layout) != len(params):
            raise ValueError(f"GradNormReducer: {len(params)} stepped tensors, bound to {len(layout)}")
        grads = [(p.grad.detach(), ranges) for i, (p, ranges) in enumerate(zip(params, layout))
                 if p.grad is not None and i not in self.uncounted]
        sq = torch.zeros(2, dtype=torch.float64, device=grads[0][0].device if grads else None)
        for g, ranges in grads:
            # float64 accumulation without a float64 copy of the tensor
            total = torch.linalg.vector_norm(g, dtype=torch.float64).square()
            if not ranges:
                sq[0] += total
            elif ranges == ((0, g.numel()),):
                sq[1] += total
            else:
                flat = g.reshape(-1)
                rep = torch.zeros((), dtype=torch.float64, device=g.device)
                for a, b in ranges:
                    rep += torch.linalg.vector_norm(flat[a:b], dtype=torch.float64).square()
                sq[0] += total - rep
                sq[1] += rep
        return sq
