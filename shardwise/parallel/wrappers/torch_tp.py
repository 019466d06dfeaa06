"""A model split by torch's own `parallelize_module` (ColwiseParallel, RowwiseParallel, ... on a tp DeviceMesh)
under `fully_shard`, torchtitan's composition:

    parallelize_module(model, mesh["tp"], plan)        # torch's: parameters become DTensors on mesh["tp"]
    fully_shard(block, mesh=mesh["dp"]) ...            # shardwise's

torch's TP layers compute on DTensors: their weights must be DTensors on the tp mesh during forward. `fully_shard`
takes each such parameter apart (`adopt`): its local tensor (this rank's TP slice) becomes the plain inner
parameter the ZeRO-3 unit gathers and reduces, marked with the tp mesh and the dim it is cut along (as
`shardwise.parallelize_module` marks its own), and `TorchTP` remembers its tp placements. While the unit is
gathered the module holds `DTensor.from_local(inner, tp mesh, placements)`, made under grad mode so that autograd
takes the gradient through it to the inner parameter (also when a recomputation inside backward runs the forward
again); at rest it holds the shown parameter on the (dp, tp) mesh, as for shardwise's own TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.errors import UserError
from shardwise.parallel.tensor_parallel.layers import TP_DIM_ATTR, TP_MESH_ATTR

TORCH_TP_ATTR = "_shardwise_torch_tp"
"""Attribute of an inner parameter taken from torch's TP: its `TorchTP`."""


@dataclass(frozen=True)
class TorchTP:
    """How torch's TP placed a parameter: what its layers expect to compute with."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]

    def forward_tensor(self, inner: torch.Tensor) -> torch.Tensor:
        """The DTensor the module computes with, over the gathered inner parameter [TP slice]."""
        from torch.distributed.tensor import DTensor
        size = torch.Size(self.shape)
        with torch.enable_grad():
            return DTensor.from_local(inner, self.mesh, self.placements, run_check=False, shape=size,
                                      stride=torch.empty(size, device="meta").stride())


@torch.no_grad()
def adopt(module: nn.Module, sharded_attr: str) -> None:
    """Replace, in place, every DTensor parameter of `module` that torch's `parallelize_module` made (on a 1-D
    mesh, Shard or Replicate) by a plain parameter of its local tensor, marked as above. Parameters `fully_shard`
    already shows as DTensors are left alone."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    taken: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not isinstance(p, DTensor) or getattr(p, sharded_attr, False):
                continue
            if id(p) not in taken:
                placement = p.placements[0] if len(p.placements) == 1 else None
                if p.device_mesh.ndim != 1 or not isinstance(placement, (Shard, Replicate)):
                    raise UserError(f'fully_shard({type(module).__name__}): parameter "{name}" of '
                                    f"{type(m).__name__} is a DTensor with placements {p.placements} on a "
                                    f"{p.device_mesh.ndim}-D mesh; give a model split by parallelize_module on the "
                                    f'1-D mesh["tp"] (Shard or Replicate placements)')
                inner = nn.Parameter(p.to_local().detach().clone(), requires_grad=p.requires_grad)
                setattr(inner, TP_MESH_ATTR, p.device_mesh)
                setattr(inner, TORCH_TP_ATTR, TorchTP(p.device_mesh, tuple(p.placements), tuple(p.shape)))
                if isinstance(placement, Shard):
                    setattr(inner, TP_DIM_ATTR, placement.dim % p.dim())
                taken[id(p)] = inner
            m._parameters[name] = taken[id(p)]
