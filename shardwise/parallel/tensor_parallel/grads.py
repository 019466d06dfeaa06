"""Whole-model quantities of a tensor-parallel model: the global gradient norm, the overflow verdict, and
the full (gathered) state dict.

Each TP rank holds a slice of every sharded parameter and a full copy of every replicated one (norms,
row-parallel biases), whose gradients are equal on all TP ranks. The global squared norm is therefore

    ||g||^2 = sum over the TP group of (sharded slices' ||g||^2)  +  (replicated ||g||^2, counted once)

and every TP rank must take the same step: clip by the same norm, skip on an overflow seen by any rank.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from shardwise.comm.collectives import Comm
from shardwise.parallel.tensor_parallel.layers import TP_DIM_ATTR, is_tensor_parallel_shard
from shardwise.parallel.tensor_parallel.mappings import all_gather


class TensorParallelGrads:
    """Clipping and overflow agreement over a TP group. `sharded[i]` says whether the i-th stepped parameter
    is a TP slice (fixed at build time from the model parameters, since fp32 masters are new tensors).
    `across`: under pipeline parallelism (3D), the pipeline group: each stage holds other layers, so both
    parts of the squared norm are summed over it too."""

    def __init__(self, comm: Comm, sharded: list[bool], across: Comm | None = None):
        self.comm = comm
        self.sharded = sharded
        self.across = across

    @classmethod
    def for_params(cls, comm: Comm, params: list[Tensor], across: Comm | None = None) -> "TensorParallelGrads":
        return cls(comm, [is_tensor_parallel_shard(p) for p in params], across)

    def global_norm(self, params: list[Tensor]) -> float:
        if len(params) != len(self.sharded):
            raise ValueError(f"TensorParallelGrads: {len(params)} parameters, built for {len(self.sharded)}")
        with_grad = [(p.grad.detach(), shard) for p, shard in zip(params, self.sharded) if p.grad is not None]
        device = with_grad[0][0].device if with_grad else torch.device("cpu")
        sq = torch.zeros(2, dtype=torch.float64, device=device)      # [sharded slices, replicated]
        for g, shard in with_grad:
            sq[0 if shard else 1] += g.double().pow(2).sum()
        if self.across is not None:
            self.across.all_reduce(sq)                                # other stages' layers (16 bytes)
        sharded_sq = sq[:1].clone()
        self.comm.all_reduce(sharded_sq)                              # one 8-byte all-reduce per step
        return math.sqrt(float(sharded_sq) + float(sq[1]))

    def clip_(self, params: list[Tensor], max_norm: float) -> float:
        """Scale every gradient by max_norm / (norm + 1e-6) when that is below 1 (torch's clip_grad_norm_
        rule) with the norm of the whole model; returns the norm."""
        norm = self.global_norm(params)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
        return norm

    def any_overflow(self, local: bool) -> bool:
        """True on every TP rank (and stage) if any of them saw inf/nan (each checks only its own slices)."""
        flag = self.comm.all_reduce_object_max(float(local))
        if self.across is not None:
            flag = self.across.all_reduce_object_max(flag)
        return flag > 0


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, comm: Comm, state: dict[str, Tensor] | None = None
                           ) -> dict[str, Tensor]:
    """The single-process model's state dict, assembled from the TP shards: every sharded parameter is
    all-gathered along its split dimension; replicated tensors are copied. Collective: every TP rank calls it.
    `state`: this rank's slice state dict when the module's own tensors are not it (under ZeRO-3 they are
    placeholders between steps; pass `engine.grad_sync.gathered_state_dict()`)."""
    own = model.state_dict(keep_vars=True)
    out = {}
    for name, t in (own if state is None else state).items():
        dim = getattr(own.get(name), TP_DIM_ATTR, None)
        out[name] = all_gather(t.detach(), comm, dim) if dim is not None else t.detach().clone()
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, Tensor], comm: Comm, strict: bool = True) -> None:
    """Load a single-process (full) state dict into a tensor-parallel model: each rank copies its slice."""
    local = {}
    own = model.state_dict(keep_vars=True)
    for name, t in full.items():
        mine = own.get(name)
        dim = getattr(mine, TP_DIM_ATTR, None) if mine is not None else None
        if dim is not None:
            n = t.shape[dim] // comm.size
            t = t.narrow(dim, comm.rank * n, n)
        local[name] = t
    model.load_state_dict(local, strict=strict)


class ShardedTensorParallelGrads:
    """The same whole-model norm and overflow verdict for ZeRO over a TP x dp mesh, where each stepped tensor
    is this rank's shard [S] of a flat bucket that mixes TP slices and replicated parameters.

    Per shard the elements of replicated parameters are the ranges `replicated[i]` (from the bucket layout);
    every other element belongs to a TP slice (or is zero padding). The engine reduces the local
    [sliced, replicated] squares over the dp group (each dp rank holds a disjoint shard); `global_norm` then
    sums the sliced part over the TP group, counting replicated elements once."""

    def __init__(self, comm: Comm, buckets: list) -> None:
        self.comm = comm
        self.replicated: list[list[tuple[int, int]]] = []
        for b in buckets:     # ZeroBucket / FlatShard: `params`, `layout`, `rank`
            self.replicated.append([(dst, dst + hi - lo) for i, lo, hi, dst in b.layout.pieces_in_shard(b.rank)
                                    if not is_tensor_parallel_shard(b.params[i])])

    def local_squares(self, grads: list[Tensor]) -> Tensor:
        """float64 [2]: this rank's (sliced, replicated) sums of squares over its shards."""
        if len(grads) != len(self.replicated):
            raise ValueError(f"ShardedTensorParallelGrads: {len(grads)} shards, built for {len(self.replicated)}")
        sq = torch.zeros(2, dtype=torch.float64, device=grads[0].device if grads else None)
        for g, ranges in zip(grads, self.replicated):      # all on the shards' device: no sync per shard
            total = g.double().pow(2).sum()
            rep = torch.zeros((), dtype=torch.float64, device=g.device)
            for a, b in ranges:
                rep += g[a:b].double().pow(2).sum()
            sq[0] += total - rep
            sq[1] += rep
        return sq

    def global_norm(self, dp_summed: Tensor) -> float:
        """The model's norm from the dp-reduced squares: TP slices summed over the TP group (8 bytes)."""
        sliced = dp_summed[:1].clone()
        self.comm.all_reduce(sliced)
        return math.sqrt(max(float(sliced), 0.0) + float(dp_summed[1]))

    def any_overflow(self, local: bool) -> bool:
        return self.comm.all_reduce_object_max(float(local)) > 0
