"""The wrappers' frozen policies, in torch's spelling: FSDP2's `MixedPrecisionPolicy` / `CPUOffloadPolicy`, FSDP1's
`MixedPrecision` / `CPUOffload`, and where the wrappers communicate (`DataParallelGroups`, from a `mesh` argument).

Mixed precision keeps the sharded parameters (what the optimizer steps) in their own dtype, fp32 usually: each
all-gather sends the shard cast to `param_dtype`, forward and backward run in it, and each gradient is cast to
`reduce_dtype` before the reduce-scatter, whose result is added to the fp32 gradient shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.errors import UserError
from shardwise.comm.topology import Axis, ParallelMesh, SoloComm


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's policy. None keeps the parameters' dtype. `buffer_dtype` (FSDP1's) casts floating buffers once."""

    param_dtype: torch.dtype | None = None
    """dtype of the gathered parameters: forward and backward compute in it."""
    reduce_dtype: torch.dtype | None = None
    """dtype gradients are reduce-scattered in (None: param_dtype, or the parameters' dtype)."""
    output_dtype: torch.dtype | None = None
    """Floating outputs of the outermost wrapped module's forward are cast to it."""
    cast_forward_inputs: bool = True
    """Cast floating inputs of each wrapped module's forward to param_dtype."""
    buffer_dtype: torch.dtype | None = None
    """Floating buffers are cast to it when the module is wrapped."""


@dataclass(frozen=True)
class OffloadPolicy:
    """FSDP2's base policy: no offloading."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Shards, their gradients and the optimizer step live on the CPU; each all-gather copies the shard to the
    compute device (asynchronously from page-locked memory with `pin_memory` and CUDA)."""

    pin_memory: bool = True


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP1's spelling of the mixed-precision policy."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class CPUOffload:
    """FSDP1's spelling: `offload_params=True` is `CPUOffloadPolicy()`."""

    offload_params: bool = False


def as_policy(mixed_precision: Any) -> MixedPrecisionPolicy:
    """FSDP1's MixedPrecision (ours or torch's: read by attribute) as FSDP2's policy; None: full precision."""
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    try:
        return MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype,
                                    reduce_dtype=mixed_precision.reduce_dtype,
                                    buffer_dtype=getattr(mixed_precision, "buffer_dtype", None),
                                    cast_forward_inputs=getattr(mixed_precision, "cast_forward_inputs", True))
    except AttributeError:
        raise UserError(f"mixed_precision = {mixed_precision!r}: give shardwise.MixedPrecision(param_dtype=..., "
                        f"reduce_dtype=..., buffer_dtype=...) or None") from None


@dataclass(frozen=True)
class DataParallelGroups:
    """The wrappers' communication: `dp` shards or replicates over the data-parallel group; `tp` is the tensor-
    parallel group of a 2-D mesh (a `SoloComm` without TP), over which gradient norms of TP slices add up."""

    dp: Comm
    tp: Comm


def groups_of(mesh: Any, *, ledger: CommLedger | None = None) -> DataParallelGroups:
    """Read a wrapper's `mesh` / `process_group` argument: None (every rank), a `torch.distributed` ProcessGroup,
    a torch `DeviceMesh` (1-D, or named dims "dp" / "dp_shard" and "tp"), shardwise's `ParallelMesh` (its dp and
    tp axes) or a `Comm`."""
    ledger = ledger if ledger is not None else CommLedger()
    if not dist.is_initialized():
        raise UserError("the process group is not initialized: call shardwise.init_distributed() (or "
                        "torch.distributed.init_process_group) before wrapping the model")
    solo = SoloComm(None, ledger, name="tp")
    if mesh is None:
        return DataParallelGroups(Comm(None, ledger, name="dp"), solo)
    if isinstance(mesh, Comm):
        return DataParallelGroups(mesh, solo)
    if isinstance(mesh, ParallelMesh):
        if mesh.size(Axis.PP) > 1:
            raise UserError("mesh: the wrappers take a (dp, tp) mesh; pipeline stages (pp > 1) need the engine "
                            "(shardwise.initialize with a \"pipeline\" block)")
        return DataParallelGroups(mesh.comm(Axis.DP, ledger, name="dp"), mesh.comm(Axis.TP, ledger, name="tp"))
    if isinstance(mesh, dist.ProcessGroup):
        return DataParallelGroups(Comm(mesh, ledger, name="dp"), solo)
    names = getattr(mesh, "mesh_dim_names", None)
    if hasattr(mesh, "get_group") and hasattr(mesh, "ndim"):          # torch's DeviceMesh
        if mesh.ndim == 1:
            return DataParallelGroups(Comm(mesh.get_group(), ledger, name="dp"), solo)
        dims = names or ()            # mesh_dim_names is None for a mesh built without names
        dp_name = next((n for n in ("dp", "dp_shard") if n in dims), None)
        if dp_name is None or mesh.ndim != 2 or "tp" not in dims:
            raise UserError(f"mesh: a {mesh.ndim}-D DeviceMesh with dims {names}; give a 1-D mesh, or a 2-D one "
                            f"with mesh_dim_names ('dp', 'tp')")
        return DataParallelGroups(Comm(mesh.get_group(dp_name), ledger, name="dp"),
                                  Comm(mesh.get_group("tp"), ledger, name="tp"))
    raise UserError(f"mesh = {mesh!r}: give None (every rank), a ProcessGroup, a DeviceMesh or a "
                    f"shardwise ParallelMesh")
