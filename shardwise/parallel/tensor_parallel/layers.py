"""Tensor-parallel layers, each cut from an ordinary full layer: `ColumnParallelLinear`, `RowParallelLinear`,
`VocabParallelEmbedding`. `t` is the TP group size, `r` this rank's position in it.

Every layer is built from the FULL layer by slicing its weights, so a tensor-parallel model starts
bit-identical to the single-process model it came from (same seed -> same full weights -> same shards).
The full layer is left untouched. A sharded parameter carries `TP_DIM_ATTR` (the dimension it was cut
along); replicated parameters do not.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.comm.collectives import Comm
from shardwise.errors import UserError
from shardwise.parallel.tensor_parallel.mappings import (
    SEQ_DIM, copy_to_region, gather_from_last_dim, gather_from_sequence, reduce_from_region, reduce_scatter_to_sequence,
    scatter_to_last_dim, sum_grad_over_region,
)
from shardwise.parallel.tensor_parallel.sequence_linear import linear_on_gathered, mark_gathered

TP_DIM_ATTR = "tensor_parallel_dim"
"""Attribute of a sharded parameter: the dimension of the full tensor it is a slice of."""


class TensorParallelError(UserError, ValueError):
    """A model or plan that cannot be split over the requested tensor-parallel size."""


def not_divisible(what: str, value: int, tp: int, fix: str) -> str:
    """One problem line: `what = value` is not divisible by the TP size, by how much, and the fix."""
    return (f"{what} = {value} is not divisible by tensor_parallel.size = {tp} "
            f"({value} = {tp} * {value // tp} + {value % tp}, {value % tp} left over); {fix}")


TP_MESH_ATTR = "_shardwise_tp_mesh"
"""Attribute of every parameter of a model split by `shardwise.parallelize_module` over a torch DeviceMesh: that
1-D tp mesh, so that `fully_shard` over the dp mesh can place the parameter on the 2-D (dp, tp) mesh."""


def is_tensor_parallel_shard(param: Tensor) -> bool:
    """True for a parameter each TP rank holds a different slice of (False: replicated)."""
    return getattr(param, TP_DIM_ATTR, None) is not None


def shard_parameter(full: Tensor, comm: Comm, dim: int, what: str) -> nn.Parameter:
    """This rank's contiguous 1/t slice of `full` along `dim`, as a new Parameter marked with its dim."""
    n, t = full.shape[dim], comm.size
    if n % t:
        raise TensorParallelError(not_divisible(f"{what} dimension {dim}", n, t,
                                                "choose a tensor_parallel.size that divides it"))
    piece = full.detach().narrow(dim, comm.rank * (n // t), n // t).clone()
    param = nn.Parameter(piece, requires_grad=full.requires_grad)
    setattr(param, TP_DIM_ATTR, dim)
    return param


def replicate_parameter(full: Tensor) -> nn.Parameter:
    return nn.Parameter(full.detach().clone(), requires_grad=full.requires_grad)


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r, W_r [out/t, in] this rank's out_features/t rows of the full weight (and of the bias).

    Input: [.., in] replicated (copy-to-region: identity forward, all-reduce of the input gradient backward),
    or with `sequence_parallel` [b, s/t, in] sequence shards (all-gather forward, reduce-scatter backward; the
    shard, not the gathered input, is kept for the weight gradient: `sequence_linear`).
    `input_in_region`: the caller already brought the input into the region once for several layers
    (e.g. q, k and v share one entry, as Megatron's fused QKV does), so this layer communicates nothing
    on its input. Output: [.., out/t], or [.., out] replicated with `gather_output`.
    """

    def __init__(self, full: nn.Linear, comm: Comm, gather_output: bool = False, sequence_parallel: bool = False,
                 *, input_in_region: bool = False):
        super().__init__()
        if not isinstance(full, nn.Linear):
            raise TypeError(f"ColumnParallelLinear is cut from an nn.Linear, got {type(full).__name__}")
        self.comm = comm
        self.in_features = full.in_features
        self.full_out_features = full.out_features
        self.out_features = full.out_features // comm.size
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.input_in_region = input_in_region
        self.weight = shard_parameter(full.weight, comm, 0, "out_features of the weight")
        if full.bias is not None:
            self.bias = shard_parameter(full.bias, comm, 0, "the bias")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_in_region:
            if self.sequence_parallel:     # keeps the [b, s/t, in] shard for backward, not the gathered input
                x = mark_gathered(gather_from_sequence(x, self.comm), x, self.comm, SEQ_DIM)
            else:
                x = copy_to_region(x, self.comm)
        y = linear_on_gathered(x, self.weight, self.bias)           # [.., out/t]
        return gather_from_last_dim(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (of {self.full_out_features}), "
                f"tp={self.comm.size}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}, input_in_region={self.input_in_region}")


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b, W_r [out, in/t] this rank's in_features/t columns of the full weight.

    Input: [.., in/t] feature shards (`input_is_parallel`, the output of a column-parallel layer), or
    [.., in] replicated, split here (split forward, all-gather backward). The partial products are
    all-reduced, or with `sequence_parallel` reduce-scattered into [b, s/t, out] sequence shards. The bias
    is replicated and added once, after the sum; under sequence parallelism each rank adds it to its own
    tokens only, so its gradient is summed over the group.
    """

    def __init__(self, full: nn.Linear, comm: Comm, input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        if not isinstance(full, nn.Linear):
            raise TypeError(f"RowParallelLinear is cut from an nn.Linear, got {type(full).__name__}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True (the input of a "
                             "sequence-parallel row layer is the feature-sharded output of a column layer)")
        self.comm = comm
        self.full_in_features = full.in_features
        self.in_features = full.in_features // comm.size
        self.out_features = full.out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = shard_parameter(full.weight, comm, 1, "in_features of the weight")
        if full.bias is not None:
            self.bias = replicate_parameter(full.bias)
            if sequence_parallel:
                sum_grad_over_region(self.bias, comm)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_last_dim(x, self.comm)
        y = F.linear(x, self.weight)                                # [.., out] partial sum of this rank
        y = reduce_scatter_to_sequence(y, self.comm) if self.sequence_parallel else reduce_from_region(y, self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (of {self.full_in_features}), out_features={self.out_features}, "
                f"tp={self.comm.size}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows: rank r holds E_r [V/t, h], ids [r V/t, (r+1) V/t).

    ids [b, s] -> each rank looks up the ids in its range and writes zeros for the others; the sum over
    the group is the full lookup [b, s, h] (all-reduce), or with `sequence_parallel` the reduce-scattered
    sequence shards [b, s/t, h].
    """

    def __init__(self, full: nn.Embedding, comm: Comm, *, sequence_parallel: bool = False):
        super().__init__()
        if not isinstance(full, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding is cut from an nn.Embedding, got {type(full).__name__}")
        unsupported = [k for k in ("max_norm", "sparse") if getattr(full, k)] + \
                      (["scale_grad_by_freq"] if full.scale_grad_by_freq else [])
        if unsupported:
            raise TensorParallelError(f"VocabParallelEmbedding does not support nn.Embedding options {unsupported}: "
                                      f"build the embedding without them or leave it out of the plan")
        self.comm = comm
        self.full_num_embeddings = full.num_embeddings
        self.embedding_dim = full.embedding_dim
        self.sequence_parallel = sequence_parallel
        self.weight = shard_parameter(full.weight, comm, 0, "num_embeddings (vocabulary) of the table")
        self.num_embeddings = self.weight.shape[0]
        self.vocab_start = comm.rank * self.num_embeddings
        self.vocab_end = self.vocab_start + self.num_embeddings
        pad = full.padding_idx
        # The full layer never updates the padding row; only the rank that holds it needs to know.
        self.padding_idx = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end \
            else None

    def forward(self, ids: Tensor) -> Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)          # [b, s] ids of other ranks
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx)               # [b, s, h]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)                     # no gradient reaches row 0 either
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.comm)
        return reduce_from_region(out, self.comm)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} of {self.full_num_embeddings} rows [{self.vocab_start}, {self.vocab_end}), "
                f"embedding_dim={self.embedding_dim}, tp={self.comm.size}, sequence_parallel={self.sequence_parallel}")
