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
    is a TP slice (fixed at build time from the model parameters, since fp32 masters are new tensors)."""

    def __init__(self, comm: Comm, sharded: list[bool]):
        self.comm = comm
        self.sharded = sharded

    @classmethod
    def for_params(cls, comm: Comm, params: list[Tensor]) -> "TensorParallelGrads":
        return cls(comm, [is_tensor_parallel_shard(p) for p in params])

    def global_norm(self, params: list[Tensor]) -> float:
        if len(params) != len(self.sharded):
            raise ValueError(f"TensorParallelGrads: {len(params)} parameters, built for {len(self.sharded)}")
        with_grad = [(p.grad.detach(), shard) for p, shard in zip(params, self.sharded) if p.grad is not None]
        device = with_grad[0][0].device if with_grad else torch.device("cpu")
        sq = torch.zeros(2, dtype=torch.float64, device=device)      # [sharded slices, replicated]
        for g, shard in with_grad:
            sq[0 if shard else 1] += g.double().pow(2).sum()
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
        """True on every TP rank if any of them saw inf/nan (each checks only its own slices)."""
        return self.comm.all_reduce_object_max(float(local)) > 0


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, comm: Comm) -> dict[str, Tensor]:
    """The single-process model's state dict, assembled from the TP shards: every sharded parameter is
    all-gathered along its split dimension; replicated tensors are copied. Collective: every TP rank calls it."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        dim = getattr(t, TP_DIM_ATTR, None)
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
