"""The single-process (full) state dict of a tensor-parallel model: gathered from the TP slices, or split
into them. Each TP rank holds a slice of every sharded parameter (marked with `TP_DIM_ATTR`, its split
dimension) and a full copy of every replicated one (norms, row-parallel biases)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardwise.comm.collectives import Comm
from shardwise.parallel.tensor_parallel.layers import TP_DIM_ATTR
from shardwise.parallel.tensor_parallel.mappings import all_gather


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, comm: Comm, state: dict[str, Tensor] | None = None, *,
                           copy: bool = True) -> dict[str, Tensor]:
    """The single-process model's state dict, assembled from the TP shards: every sharded parameter is
    all-gathered along its split dimension; replicated tensors are copied (or, with copy=False, returned as
    they are, for a caller that copies them anyway). Collective: every TP rank calls it. `state`: this rank's
    slice state dict when the module's own tensors are not it (under ZeRO-3 they are placeholders between
    steps; pass `engine.dp_runtime.gathered_state_dict(engine.module)`)."""
    own = model.state_dict(keep_vars=True)
    out = {}
    for name, t in (own if state is None else state).items():
        dim = getattr(own.get(name), TP_DIM_ATTR, None)
        if dim is not None:
            out[name] = all_gather(t.detach(), comm, dim)
        else:
            out[name] = t.detach().clone() if copy else t.detach()
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
