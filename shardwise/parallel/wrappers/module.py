"""What a module wrapped by `fully_shard` can do beyond its own class (FSDP2's `FSDPModule` methods): gradient
sync on/off, resharding, the gradient norm over the shards, and full / sharded state dicts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from shardwise.errors import UserError
from shardwise.parallel.grad_norm import GradNormReducer, whole_tensor_layout
from shardwise.parallel.wrappers.dtensors import local_of, plain_state_dicts
from shardwise.parallel.zero.flat import FlatShard
from shardwise.parallel.zero.partition import RowLayout
from shardwise.comm.topology import SoloComm


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor of a nest of args / kwargs / outputs cast to `dtype`; the rest as it is."""
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


_CLASSES: dict[type, type] = {}


def wrap_class(module: nn.Module) -> None:
    """Make `module` an instance of FSDP<its class> (also its class: isinstance checks keep working)."""
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _CLASSES[cls]


if TYPE_CHECKING:
    from shardwise.parallel.wrappers.fully_shard import FullyShardState

    # Every FSDPModule is an nn.Module: `wrap_class` mixes it into the class of a module. The checker is shown that
    # base, so the methods below read the module's members as typed; at run time the mixin derives from object.
    _ModuleBase = nn.Module
else:
    _ModuleBase = object


class FSDPModule(_ModuleBase):
    """Mixed into the class of every module `fully_shard` wrapped. Collective methods say so: every rank of the
    data-parallel group must call them in the same order."""

    def _fully_shard_state(self) -> FullyShardState:
        from shardwise.parallel.wrappers.fully_shard import STATE_ATTR
        return getattr(self, STATE_ATTR)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: the following backwards accumulate full gradients locally without communicating (gradient
        accumulation); the first backward with True reduce-scatters the sum. Applies to the whole model the
        outermost wrapper drives."""
        self._fully_shard_state().runtime.reduce_grads = bool(requires_gradient_sync)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module's forward starts, launch the all-gathers of `modules` (wrapped modules of the same
        model, in the order their forwards come), beyond the one unit gathered ahead by default (FSDP2's
        explicit forward prefetch)."""
        self._prefetch_list(modules, "set_modules_to_forward_prefetch")
        setattr(self, FORWARD_PREFETCH_ATTR, list(modules))
        self._hook_prefetch()

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module's backward starts (its outputs' gradients are ready), launch the all-gathers of
        `modules` (those whose backward comes next) beyond the default (FSDP2's explicit backward prefetch)."""
        self._prefetch_list(modules, "set_modules_to_backward_prefetch")
        setattr(self, BACKWARD_PREFETCH_ATTR, list(modules))
        self._hook_prefetch()

    def _hook_prefetch(self) -> None:
        """Once per module: the hooks that launch the listed modules' all-gathers."""
        if not getattr(self, "_shardwise_prefetch_hooked", False):
            self.register_forward_pre_hook(_prefetch_forward)
            self.register_forward_hook(_arm_backward_prefetch)
            self._shardwise_prefetch_hooked = True

    def _prefetch_list(self, modules: list[FSDPModule], fn: str) -> None:
        root = self._fully_shard_state().root
        for m in modules:
            if not isinstance(m, FSDPModule) or m._fully_shard_state().root is not root:
                raise UserError(f"{fn}: {type(m).__name__} is not a module fully_shard wrapped in this model; give "
                                f"wrapped modules of the same model")

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """nn.Module's conversions (`.to(torch.float64)`, `.double()`, `.to(device)`) as on FSDP2: the shards
        take the new dtype / device and the parameters keep viewing them (an optimizer built afterwards steps
        them; one built before keeps the same parameter objects). Not collective."""
        from shardwise.parallel.wrappers.fully_shard import STATE_ATTR
        from shardwise.parallel.wrappers.sharded_params import ShownFlat
        sharding = getattr(self, STATE_ATTR, None)
        if sharding is None:                # while fully_shard is still wrapping the module
            return super()._apply(fn, recurse)
        sharding.runtime.release_gathered()             # every parameter is its piece of the shard
        out = super()._apply(fn, recurse)
        for f in self._my_flats():
            if isinstance(f, ShownFlat):
                f.adopt_converted()
        return out

    def reshard(self) -> None:
        """Free every gathered unit now (the next forward gathers what it needs)."""
        self._fully_shard_state().runtime.release_gathered()

    def _my_flats(self) -> list[FlatShard]:
        where = self._fully_shard_state().where()
        mine = {id(where[id(p)][0]) for p in self.parameters() if id(p) in where}
        return [f for u in self._fully_shard_state().runtime.units for f in u.flats if id(f) in mine]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient shard so the whole model's gradient norm is at most `max_norm`; returns that norm
        (computed before clipping), as torch's clip_grad_norm_ does on one process. Collective over dp (and tp).
        `torch.nn.utils.clip_grad_norm_(model.parameters())` gives the same (the parameters are DTensors), except
        on a model with a 0-dim parameter, which has no Shard(0) placement and stays a plain tensor."""
        if float(norm_type) != 2.0:
            raise UserError(f"clip_grad_norm_: norm_type = {norm_type}; only the 2-norm is supported")
        sharding = self._fully_shard_state()
        where = sharding.where()
        inner: list[torch.Tensor] = []
        for p in self.parameters():              # the DTensors' rows, as the inner parameters' .grad for a while
            flat, i = where.get(id(p), (None, 0))
            if flat is None or flat.params[i] is p:
                inner.append(p)
                continue
            q = flat.params[i]
            q.grad = None if p.grad is None else local_of(p.grad)
            inner.append(q)
        try:
            return clip_sharded_(inner, max_norm, sharding.groups, dp_sharded=True)
        finally:
            for shown, held in zip(self.parameters(), inner):
                if held is not shown:
                    held.grad = None

    @torch.no_grad()
    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The whole state dict, parameters in their sharded dtype, on the CPU; with `rank0_only` the other
        ranks get None. Collective: gathers one flat at a time."""
        sharding = self._fully_shard_state()
        comm = sharding.groups.dp
        keep = not rank0_only or comm.rank == 0
        sharding.runtime.release_gathered()            # every parameter is its piece of the shard again
        values: dict[int, torch.Tensor] = {}
        for f in self._my_flats():
            full = full_tensors(f, comm, [p.data for p in f.params])
            if keep:
                for p, value in zip(f.params, full):
                    values[id(p)] = value.to("cpu", copy=True)
        if not keep:
            return None
        with plain_state_dicts(sharding):
            state = {k: v.detach().to("cpu", copy=True)
                     for k, v in self.state_dict().items()}
        where = sharding.where()
        for name, p in self.named_parameters(remove_duplicate=False):
            inner = where[id(p)][0].params[where[id(p)][1]] if id(p) in where else p
            if id(inner) in values and name in state:
                state[name] = values[id(inner)]
        return state

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load whole tensors (a `full_state_dict()`, or the unwrapped model's state dict): each rank keeps its
        rows. Not collective. An optimizer built on the parameters keeps them (the shards change in place)."""
        sharding = self._fully_shard_state()
        sharding.runtime.release_gathered()
        named = dict(self.named_parameters(remove_duplicate=False))
        where = sharding.where()
        wanted = set(named) | {n for n, _ in self.named_buffers()}
        missing = sorted(wanted - state_dict.keys())
        if missing:
            more = " ..." if len(missing) > 4 else ""
            raise UserError(f"load_full_state_dict: the state dict lacks {missing[:4]}{more}; give the full state "
                            f"dict of this model (full_state_dict() or the unwrapped model's)")
        for name, p in named.items():
            flat, i = where[id(p)]
            value = state_dict[name]
            if tuple(value.shape) != tuple(flat.shapes[i]):
                raise UserError(f'load_full_state_dict: "{name}" has shape {tuple(value.shape)}, the parameter '
                                f'{tuple(flat.shapes[i])}')
            flat.params[i].data.copy_(rank_piece(flat, i, value))      # the inner parameter: its piece of the shard
        for name, b in self.named_buffers():
            b.copy_(state_dict[name])

    def comm_report(self, step: int | None = None) -> list[dict[str, Any]]:
        """The collectives of the last complete training step (or `step`, counted from 0), in the engine's rows:
        op, group, group_size, dtype, count, bytes, seconds. See `steps.py` for what a step is here."""
        return self._fully_shard_state().clock.report(step)

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """Every sharded parameter as a DTensor whose local tensor is this rank's rows ([rows, *shape[1:]], as
        FSDP2's), and the buffers: what `state_dict()` gives (`dtensors.py`; plain local tensors under a (dp, tp)
        mesh). `torch.distributed.checkpoint` saves it and loads it at any world size; `load_state_dict` takes
        it back. Collective only for a model with a 0-dim parameter."""
        return self.state_dict()


FORWARD_PREFETCH_ATTR = "_shardwise_forward_prefetch"
BACKWARD_PREFETCH_ATTR = "_shardwise_backward_prefetch"
"""Attributes of a wrapped module: the modules whose all-gathers its forward / backward launches."""


def _units_of(module: FSDPModule, attr: str) -> list:
    """The units of the modules listed under `attr` on `module`, in the runtime that drives them now (the one of
    the outermost wrapped module: wrapping the root rebuilt it)."""
    wanted = getattr(module, attr, [])
    if not wanted:
        return []
    runtime = module._fully_shard_state().runtime
    by_module = {id(u.module): u for u in runtime.units}
    return [by_module[id(m)] for m in wanted if id(m) in by_module]


def _prefetch_forward(module: nn.Module, _args: Any) -> None:
    assert isinstance(module, FSDPModule)
    if torch._C._current_graph_task_id() != -1:        # recomputation inside a backward: no forward prefetch
        return
    units = _units_of(module, FORWARD_PREFETCH_ATTR)
    if units:
        module._fully_shard_state().runtime.prefetch_units(units)


def _arm_backward_prefetch(module: nn.Module, _args: Any, output: Any) -> None:
    """Hook the forward's outputs: when their gradient is ready, this module's backward starts."""
    assert isinstance(module, FSDPModule)
    if torch._C._current_graph_task_id() != -1 or not getattr(module, BACKWARD_PREFETCH_ATTR, None):
        return
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda _grads: module._fully_shard_state().runtime.prefetch_units(
                _units_of(module, BACKWARD_PREFETCH_ATTR)), mode="any")


# The one conversion between "a tensor laid out as this rank holds a parameter" (its rows of the shard: the
# parameter itself, or optimizer state shaped like it) and "full per-parameter tensors". Only these two functions
# and the flat's layout (`parallel/zero/partition.py`) know how a parameter is cut over the ranks.

def full_tensors(flat: FlatShard, comm, local: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Each parameter of `flat` whole ([shapes[i]], on the compute device), given per parameter a tensor laid out
    as this rank holds it (its rows) or None (zeros). All entries share one dtype, which the result keeps.
    Collective: one all-gather over `comm`, then the layout's copy out of rank-major order."""
    device = flat.compute_device or flat.shard.device
    dtype = next((t.dtype for t in local if t is not None), flat.shard.dtype)
    mine = torch.zeros(flat.layout.shard_numel, dtype=dtype, device=device)           # [S]
    for i, (lo, hi, dst) in flat.pieces.items():
        piece = local[i]
        if piece is not None:
            mine[dst:dst + hi - lo].copy_(piece.reshape(-1))
    gathered = torch.empty(flat.layout.padded_numel, dtype=dtype, device=device)      # [S * dp], rank-major
    comm.all_gather_into_tensor(gathered, mine)
    full = gathered
    if not flat.layout.gathers_in_place:
        full = torch.empty_like(gathered)
        flat.layout.copy_out(gathered, full)
    return [full[o:o + n].view(s) for o, n, s in zip(flat.layout.offsets, flat.layout.sizes, flat.shapes)]


def rank_piece(flat: FlatShard, i: int, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of parameter i's whole value `full` [shapes[i]], shaped as this rank holds it (a view
    of `full`; empty where this rank holds none of it): the inverse of `full_tensors`. Not collective."""
    if isinstance(flat.layout, RowLayout) and flat.layout.dim(i):      # a slice along another dim than 0
        return flat.layout.piece_of(i, flat.rank, full)
    lo, hi, _ = flat.pieces.get(i, (0, 0, 0))
    return full.reshape(-1)[lo:hi].view(flat.layout.local_shape(i, flat.rank))


def clip_sharded_(params: list[torch.Tensor], max_norm: float, groups, *, dp_sharded: bool) -> torch.Tensor:
    """clip_grad_norm_ over parameters that are pieces of one model spread over the dp group (`dp_sharded`) or
    replicas on it, each maybe a TP slice: the engine's `GradNormReducer` (float64 partial sums, one all-reduce
    over dp, one over tp)."""
    with_grads = [p for p in params if p.grad is not None]
    solo = SoloComm(None, groups.dp.ledger, name="pp")
    # replicas (DDP) hold equal gradients: only TP slices add up; shards add up over dp too
    norms = GradNormReducer(stage_comm=solo, model_comm=groups.dp,
                            tp_comm=groups.tp).for_tensors(whole_tensor_layout(with_grads), dp_sharded=dp_sharded)
    return torch.tensor(norms.clip_(with_grads, float(max_norm)))
