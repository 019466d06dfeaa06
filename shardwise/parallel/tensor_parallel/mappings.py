"""The conjugate communication operators of tensor parallelism, as explicit autograd functions.

A tensor-parallel region is entered and left through operators that are the identity on one side of
autograd and a collective on the other, so that both passes stay exact (Megatron's f and g: `copy_to_region`,
`reduce_from_region`; under sequence parallelism `gather_from_sequence`, `reduce_scatter_to_sequence`). Every
operator takes the `Comm` of the TP group explicitly; nothing reads a global group, and every byte is recorded in
that Comm's ledger. Shapes are [b, s, h] (batch first, as the GPT).
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardwise.comm.collectives import Comm

SEQ_DIM = 1
"""Sequence dimension of [b, s, h] activations: under sequence parallelism rank r holds positions
[r * s/t, (r + 1) * s/t)."""

GRAD_SUMMED_ATTR = "tensor_parallel_grad_summed"
"""Set on a parameter whose gradient `sum_grad_over_region` sums over the TP group."""


# -- plain collectives on one dimension (no autograd) -------------------------------------------------

def _dim(x: Tensor, dim: int) -> int:
    return dim % x.dim()


def _check_divisible(x: Tensor, dim: int, comm: Comm, what: str) -> int:
    n, t = x.shape[dim], comm.size
    if n % t:
        raise ValueError(f"{what}: dimension {dim} of a {tuple(x.shape)} tensor has {n} entries, which is not "
                         f"divisible by the tensor-parallel size {t} ({n} = {t} * {n // t} + {n % t}); "
                         f"with sequence parallelism use sequence lengths that are a multiple of {t}")
    return n // t


def all_reduce(x: Tensor, comm: Comm) -> Tensor:
    """Sum over the group into a new contiguous tensor (the input may be aliased elsewhere: autograd
    hands the same gradient object to both inputs of an add)."""
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out)
    return out


def all_gather(x: Tensor, comm: Comm, dim: int) -> Tensor:
    """[.., n, ..] -> [.., t * n, ..]: the group's chunks concatenated along `dim` in group-rank order."""
    dim = _dim(x, dim)
    first = x.movedim(dim, 0).contiguous()                        # [n, ...]: the collective concatenates dim 0
    out = first.new_empty((comm.size * first.shape[0], *first.shape[1:]))
    comm.all_gather_into_tensor(out, first)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: Tensor, comm: Comm, dim: int) -> Tensor:
    """[.., t * n, ..] -> [.., n, ..]: sum over the group, keep this rank's chunk of `dim`."""
    dim = _dim(x, dim)
    n = _check_divisible(x, dim, comm, "reduce-scatter")
    first = x.movedim(dim, 0).contiguous()                        # [t * n, ...]
    out = first.new_empty((n, *first.shape[1:]))
    comm.reduce_scatter_tensor(out, first)
    return out.movedim(0, dim).contiguous()


def split(x: Tensor, comm: Comm, dim: int) -> Tensor:
    """[.., t * n, ..] -> [.., n, ..]: this rank's chunk of `dim` (no communication)."""
    dim = _dim(x, dim)
    n = _check_divisible(x, dim, comm, "split")
    return x.narrow(dim, comm.rank * n, n).contiguous()


# -- autograd functions -------------------------------------------------------------------------------

class _CopyToRegion(torch.autograd.Function):
    """Identity forward; the input gradient is summed over the group (each rank saw part of the use)."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return all_reduce(grad, ctx.comm), None


class _ReduceFromRegion(torch.autograd.Function):
    """Sum of the ranks' partial results forward; the gradient of a sum is passed through unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm) -> Tensor:
        return all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """[b, s/t, h] shards -> [b, s, h] forward; backward reduce-scatters the (partial) gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, dim: int) -> Tensor:
        ctx.comm, ctx.dim = comm, dim
        return all_gather(x, comm, dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return reduce_scatter(grad, ctx.comm, ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """[b, s, h] partial sums -> [b, s/t, h] reduced shards forward; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, dim: int) -> Tensor:
        ctx.comm, ctx.dim = comm, dim
        return reduce_scatter(x, comm, dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return all_gather(grad, ctx.comm, ctx.dim), None, None


class _Scatter(torch.autograd.Function):
    """Replicated [.., t n, ..] -> own chunk forward; backward all-gathers the chunks' gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, dim: int) -> Tensor:
        ctx.comm, ctx.dim = comm, dim
        return split(x, comm, dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return all_gather(grad, ctx.comm, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    """Chunks -> replicated concatenation forward; backward keeps this rank's chunk of the gradient
    (every rank holds the same full gradient after a replicated consumer)."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, dim: int) -> Tensor:
        ctx.comm, ctx.dim = comm, dim
        return all_gather(x, comm, dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return split(grad, ctx.comm, ctx.dim), None, None


# -- public operators ---------------------------------------------------------------------------------
# A group of one needs none of this: each operator is then the identity, with no autograd node.

def copy_to_region(x: Tensor, comm: Comm) -> Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce backward (Megatron's f)."""
    return x if comm.size == 1 else _CopyToRegion.apply(x, comm)


def reduce_from_region(x: Tensor, comm: Comm) -> Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward (Megatron's g)."""
    return x if comm.size == 1 else _ReduceFromRegion.apply(x, comm)


def gather_from_sequence(x: Tensor, comm: Comm, dim: int = SEQ_DIM) -> Tensor:
    """Enter a TP region from sequence shards: all-gather forward, reduce-scatter backward."""
    return x if comm.size == 1 else _GatherFromSequence.apply(x, comm, dim)


def reduce_scatter_to_sequence(x: Tensor, comm: Comm, dim: int = SEQ_DIM) -> Tensor:
    """Leave a TP region into sequence shards: reduce-scatter forward, all-gather backward."""
    return x if comm.size == 1 else _ReduceScatterToSequence.apply(x, comm, dim)


def scatter_to_sequence(x: Tensor, comm: Comm, dim: int = SEQ_DIM) -> Tensor:
    """Replicated activations -> this rank's sequence shard: split forward, all-gather backward."""
    return x if comm.size == 1 else _Scatter.apply(x, comm, dim)


def gather_from_last_dim(x: Tensor, comm: Comm) -> Tensor:
    """Feature shards [.., n/t] -> replicated [.., n]: all-gather forward, split backward."""
    return x if comm.size == 1 else _Gather.apply(x, comm, -1)


def scatter_to_last_dim(x: Tensor, comm: Comm) -> Tensor:
    """Replicated [.., n] -> this rank's feature shard [.., n/t]: split forward, all-gather backward."""
    return x if comm.size == 1 else _Scatter.apply(x, comm, -1)


def sum_grad_over_region(param: torch.nn.Parameter, comm: Comm) -> None:
    """The conjugate of "replicated parameter used on sharded activations". A replicated parameter applied to
    rank-local data (a norm on sequence shards, a bias added after a reduce-scatter, HF's
    "replicated_with_grad_allreduce"): each rank computes a partial gradient, so sum it over the group before it
    is accumulated into `.grad`. Idempotent per parameter."""
    if comm.size == 1 or getattr(param, GRAD_SUMMED_ATTR, False):
        return
    param.register_hook(lambda grad: all_reduce(grad, comm))
    setattr(param, GRAD_SUMMED_ATTR, True)
