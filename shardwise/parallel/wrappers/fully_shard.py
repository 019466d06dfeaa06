"""`fully_shard`: FSDP2's composable shape on shardwise's ZeRO-3 units and hooks.

    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    fully_shard(model)                              # the outermost call last: one runtime for the whole model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)    # steps this rank's shards
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.errors import ArgumentError, UserError
from shardwise.parallel.tensor_parallel.layers import TP_DIM_ATTR, TP_MESH_ATTR
from shardwise.parallel.wrappers import dtensors, torch_tp
from shardwise.parallel.wrappers.policies import (
    CPUOffloadPolicy, DataParallelGroups, MixedPrecisionPolicy, OffloadPolicy, groups_of,
)
from shardwise.parallel.wrappers.steps import StepClock
from shardwise.parallel.wrappers.sharded_params import Placed, ShownFlat, param_slots, placement
from shardwise.parallel.wrappers.stale_optimizer import mark_replaced
from shardwise.parallel.zero.flat import FlatKey, FlatShard
from shardwise.parallel.zero.params import Partition, Unit
from shardwise.parallel.zero.partition import RowLayout
from shardwise.parallel.zero.stage3 import ZeroParamRuntime

if TYPE_CHECKING:
    from shardwise.parallel.wrappers.module import FSDPModule

SHARDED_ATTR = "_shardwise_sharded"
"""Set on every parameter a `fully_shard` call has sharded."""

STATE_ATTR = "_shardwise_fully_shard"
"""Attribute of every wrapped module: its `FullyShardState` (the one of the outermost wrapped module above it)."""

RESHARD_POLICY_ATTR = "_shardwise_reshard_after_forward"
"""Attribute of each module `fully_shard` was called on: the `reshard_after_forward` it was given (None resolves
by position: False while it is the root, True once a later call adopts it)."""


@dataclass(eq=False)
class FullyShardState:
    """What `fully_shard` keeps for a model (FSDP2's `FSDPState`): one runtime and what it drives, the outermost
    module wrapped so far (`root`); every wrapped module below it holds this same object. `ledger` records the collectives of its groups, in the steps `clock` tells."""

    root: nn.Module
    runtime: ZeroParamRuntime
    groups: DataParallelGroups
    ledger: CommLedger
    clock: StepClock
    mesh: Any = None
    """The 1-D DeviceMesh over the dp group (0-dim parameters' state dict entries are placed on it); None under
    a (dp, tp) mesh, where each parameter's own placement (`ShownFlat.specs`) says where it lives."""

    def where(self) -> dict[int, tuple[FlatShard, int]]:
        """id(parameter) -> (its flat, its index there), for the inner and the shown parameters alike."""
        out = {}
        for f in self.runtime.partition.flats:
            for i, p in enumerate(f.params):
                out[id(p)] = (f, i)
            for i, p in enumerate(getattr(f, "shown", ())):
                out[id(p)] = (f, i)
        return out


def _same_group(a: DataParallelGroups, b: DataParallelGroups) -> bool:
    import torch.distributed as dist
    ranks = [dist.get_process_group_ranks(g.dp.group or dist.group.WORLD) if g.dp.size > 1 else [g.dp.rank]
             for g in (a, b)]
    return ranks[0] == ranks[1]


def _compute_device(groups: DataParallelGroups, params: list[nn.Parameter]) -> torch.device:
    """Where forward runs: the current CUDA device under NCCL, else where the parameters are."""
    if groups.dp.size > 1 and groups.dp.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return params[0].device if params else torch.device("cpu")


def _check_policies(reshard_after_forward: Any, mp_policy: Any, offload_policy: Any) -> None:
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise UserError(f"reshard_after_forward = {reshard_after_forward!r}: give True (free after forward), "
                        f"False (keep gathered until backward), None (False for the root, True below it) or an "
                        f"int group size dividing the data-parallel size")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise UserError(f"mp_policy = {mp_policy!r}: give shardwise.MixedPrecisionPolicy(param_dtype=..., "
                        f"reduce_dtype=...)")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise UserError(f"offload_policy = {offload_policy!r}: give shardwise.CPUOffloadPolicy() or None")


def _resolve_reshard(reshard_after_forward: bool | int | None, dp_size: int) -> bool | None:
    """FSDP2's int `reshard_after_forward`, the group size its parameters are resharded to after forward: 1 keeps
    them gathered (False), the dp size reshards them over the group (True). A size between, which FSDP2 reshards
    to within each group of that many ranks (all-gathered again there for backward), frees them to this rank's
    shard after forward as True does: the same parameters, values and gradients, less memory held between
    forward and backward, and backward's all-gather over the whole dp group instead of the smaller one."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    k = int(reshard_after_forward)
    if k < 1 or dp_size % k:
        raise ArgumentError(f"reshard_after_forward = {k}: an int is the group size to reshard to after forward "
                            f"and must divide the data-parallel size {dp_size}; give one of "
                            f"{[d for d in range(1, dp_size + 1) if dp_size % d == 0]}, or True / False")
    return k != 1


def fully_shard(module: nn.Module, *, mesh: Any = None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy | None = None) -> FSDPModule:
    """Shard `module`'s parameters over the data-parallel group of `mesh` (see `policies.groups_of`); apply it to
    each block, then to the root. Returns the module itself, its class now also a `FSDPModule`.

    Each call shards at once: the module's parameters not already wrapped below it become one ZeRO-3 unit
    (`_new_unit`), and the units wrapped below are adopted, so the outermost call leaves one `ZeroParamRuntime`
    that gathers, frees, prefetches and reduce-scatters exactly as the engine's stage 3 does. The units use
    `RowLayout`, FSDP2's dim-0 sharding; the engine's keep `FlatLayout` (its checkpoints depend on it).
    `model.state_dict()` is the sharded state dict: each sharded parameter a DTensor (Shard(0) over the dp group)
    whose local tensor is this rank's rows, as FSDP2's (`dtensors.py`); `full_state_dict()` gathers the whole.
    `shard_placement_fn(param)` (FSDP2's) may return None or Shard(k) for each parameter: cut along dim k
    (`_shard_dims`; dim 0 by default). `reshard_after_forward=None` (the default, FSDP2's): the module wrapped
    last (the root, whose backward starts at once) keeps its parameters gathered after forward, and a module
    once a later call adopts it frees them; True frees them after forward, the root's too; an int is FSDP2's
    group size to reshard to (`_resolve_reshard`)."""
    from shardwise.parallel.wrappers.module import FSDPModule, cast_floating, wrap_class
    _check_policies(reshard_after_forward, mp_policy, offload_policy)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise UserError(f"fully_shard({type(module).__name__}): a container has no forward to gather around; "
                        f"apply it to each of its modules")
    if hasattr(module, STATE_ATTR):
        raise UserError(f"fully_shard: {type(module).__name__} is already wrapped; apply it once per module")
    inside = set(map(id, module.modules()))
    below = {id(g): g for m in module.modules() if (g := getattr(m, STATE_ATTR, None)) is not None}
    for g in below.values():
        if id(g.root) not in inside:
            raise UserError(f"fully_shard({type(module).__name__}): a module above it is already wrapped; apply "
                            f"fully_shard to the blocks first and to the root last")
    below_params = {k for g in below.values() for k in g.where()}
    if any(getattr(p, SHARDED_ATTR, False) and id(p) not in below_params for p in module.parameters()):
        raise UserError(f"fully_shard({type(module).__name__}): some of its parameters are already sharded by a "
                        f"module above it or one sharing them; apply fully_shard to the blocks first and to the "
                        f"root last (a parameter shared by two blocks belongs to their common parent's call)")
    torch_tp.adopt(module, SHARDED_ATTR)          # torch's parallelize_module's DTensors, taken apart
    ledger = next(iter(below.values())).ledger if below else CommLedger()
    clock = next(iter(below.values())).clock if below else StepClock(ledger)
    groups = _with_tp(groups_of(mesh, ledger=ledger), module, mesh, ledger)
    reshard_after_forward = _resolve_reshard(reshard_after_forward, groups.dp.size)
    model_tp_mesh = _tp_mesh_of(module) if groups.tp.size > 1 else None
    for g in below.values():
        if not _same_group(g.groups, groups):
            raise UserError(f"fully_shard({type(module).__name__}): its blocks were wrapped over another group of "
                            f"ranks; pass the same mesh to every fully_shard call")
        g.runtime.close()
    order = {id(m): k for k, m in enumerate(module.modules())}
    adopted = sorted((u for g in below.values() for u in g.runtime.units), key=lambda u: order[id(u.module)])
    owned = {id(p) for u in adopted for f in u.flats for p in [*f.params, *getattr(f, "shown", ())]}
    params = [p for p in module.parameters() if id(p) not in owned]
    dims = _shard_dims(module, params, shard_placement_fn, groups)
    device = _compute_device(groups, params)
    done = {id(x) for m in module.modules() if hasattr(m, STATE_ATTR) for x in m.modules()}
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(device)
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None and id(m) not in done:     # buffers of wrapped blocks were handled then
                    dtype = mp_policy.buffer_dtype if b.is_floating_point() and mp_policy.buffer_dtype else b.dtype
                    m._buffers[name] = b.to(device, dtype)
    units = list(adopted)
    for u in adopted:               # no longer the root: FSDP2's None frees after forward below the root
        if getattr(u.module, RESHARD_POLICY_ATTR, True) is None:
            u.reshard_after_forward = True
    setattr(module, RESHARD_POLICY_ATTR, reshard_after_forward)
    mine = _new_unit(module, params, groups, device, mp_policy, offload_policy, bool(reshard_after_forward), dims)
    dt_mesh = next(iter(below.values())).mesh if below else dtensors.dp_device_mesh(groups, device)
    if mine is not None:
        units.append(mine)
        slots = param_slots(module)
        for f in mine.flats:
            assert isinstance(f, ShownFlat)
            f.present([_placement(p, tuple(shape), mesh, dt_mesh, groups, model_tp_mesh, dims.get(id(p), 0))
                       for p, shape in zip(f.params, f.shapes)], slots, SHARDED_ATTR)
            mark_replaced(f.params, f.shown)      # an optimizer built before this call is refused at its step
    names = {id(m): n for n, m in module.named_modules()}
    for k, u in enumerate(units):
        u.index, u.is_root = k, u is mine
        u.name = names.get(id(u.module)) or "<root>"
        for f in u.flats:
            f.unit = k
    partition = Partition(units, [], groups.dp.size, groups.dp.rank, 0, 0)
    largest = max((u.padded_numel for u in units if not u.is_root), default=1)
    # one unit gathered ahead (FSDP2's default prefetch), no bound on what is gathered at once beyond that; the
    # root's own unit is freed after forward only when asked explicitly (True, or an int above 1), as FSDP2
    runtime = ZeroParamRuntime(module, partition, groups.dp, persistent=None, prefetch_numel=largest,
                               max_live_numel=1 << 62,
                               reshard_root_after_forward=mine is not None and mine.reshard_after_forward)
    sharding = FullyShardState(module, runtime, groups, ledger, clock, dt_mesh)
    for m in module.modules():
        if m is module or hasattr(m, STATE_ATTR):
            setattr(m, STATE_ATTR, sharding)
    wrap_class(module)
    dtensors.install(module, lambda m: getattr(m, STATE_ATTR))
    # first of the root's forward pre-hooks, ahead of the runtime's gathers: they count in the step it opens
    module.register_forward_pre_hook(_clock_forward, prepend=True)
    if mp_policy.param_dtype is not None and mp_policy.cast_forward_inputs:
        dtype = mp_policy.param_dtype
        module.register_forward_pre_hook(lambda _m, args, kwargs: (cast_floating(args, dtype),
                                                                   cast_floating(kwargs, dtype)), with_kwargs=True)
    if mp_policy.output_dtype is not None:
        out = mp_policy.output_dtype
        module.register_forward_hook(lambda _m, _args, output: cast_floating(output, out))
    assert isinstance(module, FSDPModule)
    return module


def _shard_dims(module: nn.Module, params: list[nn.Parameter], fn: Callable[[nn.Parameter], Any] | None,
                groups: DataParallelGroups) -> dict[int, int]:
    """FSDP2's `shard_placement_fn`: id(parameter) -> the dim it is cut along, for those it gives Shard(k), k > 0
    (None and Shard(0): dim 0). Another dim needs an even cut (the dp size divides it there, as FSDP2 asks) and a
    model without tensor parallelism."""
    from torch.distributed.tensor import Shard
    if fn is None:
        return {}
    names = {id(p): n for n, p in module.named_parameters()}
    dims = {}
    for p in params:
        placement = fn(p)
        if placement is None:
            continue
        if not isinstance(placement, Shard) or not -p.dim() <= placement.dim < max(p.dim(), 1):
            raise UserError(f'fully_shard: shard_placement_fn gave {placement!r} for parameter "{names.get(id(p))}" '
                            f"(shape {tuple(p.shape)}); return None or Shard(dim) with a dim of the parameter")
        k = placement.dim % p.dim() if p.dim() else 0
        if k == 0:
            continue
        if groups.tp.size > 1 or p.shape[k] % groups.dp.size:
            raise UserError(f'fully_shard: shard_placement_fn gave Shard({k}) for parameter "{names.get(id(p))}" '
                            f"(shape {tuple(p.shape)}); a dim other than 0 must split evenly over the "
                            f"{groups.dp.size} data-parallel ranks and the model have no tensor parallelism: "
                            f"return Shard(0) for it")
        dims[id(p)] = k
    return dims


def _tp_mesh_of(module: nn.Module) -> Any:
    """The 1-D tp DeviceMesh the module's parameters were split over (by `shardwise.parallelize_module`, or by
    torch's, taken apart by `torch_tp.adopt`), or None."""
    for p in module.parameters():
        tp_mesh = getattr(p, TP_MESH_ATTR, None)
        if tp_mesh is not None:
            return tp_mesh
    return None


def _with_tp(groups: DataParallelGroups, module: nn.Module, mesh: Any, ledger: CommLedger) -> DataParallelGroups:
    """`groups` with the tp group of a model split over a tp DeviceMesh, when `mesh` is the dp dimension of the
    same (dp, tp) DeviceMesh."""
    tp_mesh = _tp_mesh_of(module)
    if tp_mesh is None or groups.tp.size > 1:
        return groups
    root = tp_mesh._get_root_mesh()
    names = getattr(mesh, "mesh_dim_names", None)
    if root is tp_mesh or root.ndim != 2 or not names or mesh._get_root_mesh() != root:
        raise UserError(f"fully_shard({type(module).__name__}): the model is split over the tp mesh "
                        f"{tp_mesh.mesh_dim_names}; pass mesh=mesh[\"dp\"] of the same 2-D init_device_mesh(..., "
                        f"mesh_dim_names=(\"dp\", \"tp\"))")
    return DataParallelGroups(groups.dp, Comm(tp_mesh.get_group(), ledger, name="tp"))


def _placement(p: nn.Parameter, shape: tuple[int, ...], mesh: Any, dp_mesh: Any, groups: DataParallelGroups,
               model_tp_mesh: Any, dim: int = 0) -> Placed | None:
    """How parameter `p` (of `shape`, a TP slice under TP) is shown; None: as its plain rows. Under a tp
    DeviceMesh a parameter outside the TP plan is on the (dp, tp) mesh too, replicated over tp. `dim`: the dim
    it is cut along over dp (`_shard_dims`; 0 under TP)."""
    tp_mesh = getattr(p, TP_MESH_ATTR, None) or model_tp_mesh
    if tp_mesh is None:
        # a tp group known only as a process group (ParallelMesh): TP slices this module cannot place
        return placement(dp_mesh, shape, dim=dim) if groups.tp.size == 1 else None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if getattr(mesh, "ndim", 0) == 2:           # the (dp, tp) DeviceMesh itself
        mesh = mesh["dp" if "dp" in names else "dp_shard"]
    elif not names:
        return None                             # a ParallelMesh or a process group: no DeviceMesh to place on
    return placement(mesh, shape, tp_mesh=tp_mesh, tp_dim=getattr(p, TP_DIM_ATTR, None))


def _clock_forward(module: nn.Module, _args: Any) -> None:
    """Tell the step clock a forward of the root starts (`steps.StepClock`)."""
    sharding = getattr(module, STATE_ATTR)
    if sharding.root is not module:
        return
    if torch.is_grad_enabled():
        sharding.clock.forward_started(sharding.runtime.reduce_grads)
    else:
        sharding.clock.eval_forward_started()


def _new_unit(module: nn.Module, params: list[nn.Parameter], groups: DataParallelGroups, device: torch.device,
              mp: MixedPrecisionPolicy, offload: OffloadPolicy | None, reshard_after_forward: bool,
              dims: dict[int, int]) -> Unit | None:
    """The unit of `module`'s own parameters (those no wrapped module below holds), sharded; None when there are
    none.

    Where the optimizer steps: each parameter, while its unit is sharded, is its rows of the shard, shape
    [rows_r, *shape[1:]] (fewer or 0 rows on the last ranks: `RowLayout`), and its `.grad` the same rows of the
    averaged gradient (`FlatShard.params_view_shard`), so any `torch.optim` optimizer built afterwards steps the
    shards in place. The module holds them as DTensors of the whole shape over those rows (`sharded_params.py`,
    made by the caller once the mesh is known), so code that reads `p.dim()` or `p.shape` (nanoGPT's weight-decay
    grouping) sees what it would on one process. A 0-dim parameter is one row of one element: it lives on rank 0
    (shape []), an empty [0] elsewhere, and is shown as that plain piece."""
    if not params:
        return None
    by_key: dict[FlatKey, list[nn.Parameter]] = {}
    for p in params:
        by_key.setdefault(FlatKey(0 if p.requires_grad else None, p.dtype), []).append(p)
    flats: list[FlatShard] = [ShownFlat.allocate(0, key, ps, [p.shape for p in ps], dp_size=groups.dp.size,
                                                 rank=groups.dp.rank, device=device, layout_type=RowLayout,
                                                 shard_dims=tuple(dims.get(id(p), 0) for p in ps))
                              for key, ps in by_key.items()]
    unit = Unit(0, type(module).__name__, module, flats, is_root=True)
    unit.reshard_after_forward = reshard_after_forward
    with torch.no_grad():
        for f in unit.flats:
            for i, p in enumerate(f.params):
                f.copy_piece(i, p.detach())
                setattr(p, SHARDED_ATTR, True)
            if isinstance(offload, CPUOffloadPolicy):
                pin = offload.pin_memory and torch.cuda.is_available()
                f.offload(torch.device("cpu"), pin_memory=pin)
                if f.grad_shard is not None:    # the optimizer steps on the host: gradients live there too
                    f.grad_shard = torch.zeros(f.grad_shard.shape, dtype=f.grad_shard.dtype, pin_memory=pin)
            f.compute_dtype = mp.param_dtype if mp.param_dtype is not None and f.key.dtype.is_floating_point \
                else None
            f.reduce_dtype = mp.reduce_dtype or f.compute_dtype
            f.params_view_shard = True
            f.release()
    return unit
