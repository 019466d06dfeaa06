"""Model and optimizer state dicts of a wrapped model, in the shape of `torch.distributed.checkpoint.state_dict`:

    model_sd, optim_sd = shardwise.get_state_dict(model, optimizer, full_state_dict=True, cpu_offload=True)
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, path)         # whole tensors: any world size loads it
    ...
    ckpt = torch.load(path)                                               # on every rank, at any world size
    shardwise.set_state_dict(model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"],
                             full_state_dict=True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import UserError
from shardwise.parallel.wrappers.dtensors import (
    dp_mesh, init_optim_state, is_dtensor, local_of, placed, plain_state_dicts, rows_of, to_dtensor, to_local,
)
from shardwise.parallel.wrappers.from_rank0 import broadcast_from_rank0 as from_rank0
from shardwise.parallel.wrappers.from_rank0 import dp_comm
from shardwise.parallel.wrappers.module import FSDPModule, full_tensors, rank_piece

STATE, GROUPS, PARAMS = "state", "param_groups", "params"


@dataclass(frozen=True)
class _Target:
    """The module whose parameter names are the FQNs, and the `fully_shard` root when its parameters are sharded."""

    module: nn.Module
    sharded: FSDPModule | None

    def names(self) -> dict[int, str]:
        """id(parameter) -> FQN; a shared parameter under its first name, as `named_parameters()` gives it. A
        sharded parameter's inner tensor (`sharded_params.py`) under its shown parameter's name."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        if self.sharded is not None:
            for f in self.sharded._fully_shard_state().runtime.partition.flats:
                for p, shown in zip(f.params, getattr(f, "shown", ())):
                    if id(shown) in names:
                        names.setdefault(id(p), names[id(shown)])
        return names

    def where(self) -> dict[int, tuple[Any, int]]:
        """id(parameter) -> (its flat, its index there), for sharded parameters (inner and shown)."""
        return {} if self.sharded is None else self.sharded._fully_shard_state().where()

    def reshard(self) -> None:
        """Every sharded parameter back on its piece of the shard, which the optimizer's state is laid out like."""
        if self.sharded is not None:
            self.sharded._fully_shard_state().runtime.release_gathered()


def _target(model: nn.Module, fn: str) -> _Target:
    from shardwise.parallel.wrappers.ddp import DistributedDataParallel
    from shardwise.parallel.wrappers.fsdp import FullyShardedDataParallel
    if isinstance(model, (FullyShardedDataParallel, DistributedDataParallel)):
        model = model.module
    if isinstance(model, FSDPModule):
        if model._fully_shard_state().root is not model:
            raise UserError(f"{fn}: {type(model).__name__} is wrapped inside another fully_shard'ed module; pass "
                            f"the outermost one (the model)")
        return _Target(model, model)
    return _Target(model, None)


def _optimizers(optimizers: Any) -> tuple[torch.optim.Optimizer, ...]:
    out = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers or ())
    for o in out:
        if not isinstance(o, torch.optim.Optimizer):
            raise UserError(f"optimizers = {o!r}: give a torch.optim.Optimizer or a list of them")
    return out


def _param_names(target: _Target, optim: torch.optim.Optimizer, fn: str) -> list[str]:
    """The FQN of each parameter the optimizer steps, in its index order."""
    names = target.names()
    params = [p for g in optim.param_groups for p in g[PARAMS]]
    for p in params:
        if id(p) not in names:
            raise UserError(f"{fn}: the optimizer steps a tensor of shape {tuple(p.shape)} that is not a parameter "
                            f"of the model; build the optimizer on model.parameters() after wrapping")
    return [names[id(p)] for p in params]


def _laid_out_like(value: Any, p: torch.Tensor) -> bool:
    """State laid out like its parameter (exp_avg, momentum_buffer): what gathers to the whole shape."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape


# -- getting ---------------------------------------------------------------------------------------

def _named_optim_state(target: _Target, optims: Iterable[torch.optim.Optimizer], fn: str,
                       natives: list[dict] | None = None) -> dict[str, Any]:
    """Each optimizer's own state dict (or the given `natives`) merged and keyed by FQN; tensors as they are."""
    out: dict[str, Any] = {STATE: {}, GROUPS: []}
    for k, optim in enumerate(optims):
        names = _param_names(target, optim, fn)
        osd = optim.state_dict() if natives is None else natives[k]
        # state of a parameter held as a DTensor is one too: its rows, as the rest of this module lays them out
        out[STATE].update({names[i]: {key: local_of(v) if target.sharded is not None else v
                                      for key, v in s.items()} for i, s in osd[STATE].items()})
        out[GROUPS].extend({**g, PARAMS: [names[i] for i in g[PARAMS]]} for g in osd[GROUPS])
    return out


@torch.no_grad()
def _gather_optim_state(sharded: FSDPModule, names: dict[int, str], named: dict[str, Any]) -> None:
    """Replace, in place, every state tensor laid out like its sharded parameter's piece by the whole tensor
    (`names`: id(parameter) -> FQN). Collective over dp: flats in the partition's order, state keys sorted, the
    same on every rank."""
    comm = sharded._fully_shard_state().groups.dp
    state = named[STATE]
    for flat in sharded._fully_shard_state().runtime.partition.flats:
        fqns = [names.get(id(p)) for p in flat.params]
        held = [(i, state[n]) for i, n in enumerate(fqns) if n in state]
        keys = sorted({k for i, s in held for k, v in s.items() if _laid_out_like(v, flat.params[i])})
        for key in keys:
            local: list[torch.Tensor | None] = [None] * len(flat.params)
            for i, s in held:
                if _laid_out_like(s.get(key), flat.params[i]):
                    local[i] = s[key]
            whole = full_tensors(flat, comm, local)
            for i, s in held:
                if local[i] is not None:
                    s[key] = whole[i].clone()


def _place_optim_state(sharded: FSDPModule, names: dict[int, str], named: dict[str, Any]) -> None:
    """Replace, in place, every state tensor laid out like its sharded parameter's piece by a DTensor of the whole
    (its local tensor the piece, as the model's sharded state dict); scalar state (step) stays as it is."""
    sharding = sharded._fully_shard_state()
    state = named[STATE]
    scalars = []
    for flat in sharding.runtime.partition.flats:
        for i, p in enumerate(flat.params):
            held = state.get(names.get(id(p)), {})
            if not tuple(flat.shapes[i]):
                scalars.append((flat, i, held))
                continue
            if placed(flat, i) is None:         # shown as plain rows (a TP slice without a DeviceMesh)
                continue
            for key in [k for k, v in held.items() if _laid_out_like(v, p)]:
                held[key] = to_dtensor(sharding, flat, i, held[key])
    if not scalars or sharding.groups.dp.size == 1 or dp_mesh(sharding) is None:
        return
    # A 0-dim parameter's piece is [] on rank 0, like its scalar state: only the other ranks (pieces [0]) can
    # tell which keys follow it. Collective: rank 1's answer, then each piece broadcast from rank 0.
    pieces = [sorted(k for k, v in held.items() if isinstance(v, torch.Tensor) and tuple(v.shape) == (0,))
              for _, _, held in scalars]
    pieces = sharding.groups.dp.all_gather_object(pieces)[1]
    for (flat, i, held), keys in zip(scalars, pieces):
        for key in keys:
            held[key] = to_dtensor(sharding, flat, i, held[key])


def _to_cpu(tree: Any) -> Any:
    if is_dtensor(tree):            # its rows copied to the host, still placed over the group
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(tree.to_local().to("cpu", copy=True), tree.device_mesh, tree.placements,
                                  run_check=False, shape=tree.shape, stride=tree.stride())
    if isinstance(tree, torch.Tensor):
        return tree.to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cpu(v) for v in tree]
    return tree


def _rank(target: _Target) -> int:
    if target.sharded is not None:
        return target.sharded._fully_shard_state().groups.dp.rank
    return dist.get_rank() if dist.is_initialized() else 0


def optim_state(model: nn.Module, optimizers: Any, *, full: bool, to_cpu: bool, rank0_only: bool,
                natives: list[dict] | None = None, fn: str = "get_state_dict") -> dict[str, Any]:
    """The optimizers' state keyed by FQN, full or this rank's pieces; {} off rank 0 with `rank0_only`.
    Collective when `full` and the model is sharded."""
    target = _target(model, fn)
    target.reshard()
    if natives is None:
        for optim in _optimizers(optimizers):
            init_optim_state(optim)
    named = _named_optim_state(target, _optimizers(optimizers), fn, natives)
    if full and target.sharded is not None:
        _gather_optim_state(target.sharded, target.names(), named)
    elif target.sharded is not None:
        _place_optim_state(target.sharded, target.names(), named)
    if rank0_only and _rank(target) != 0:
        return {}
    # without `to_cpu`, like torch's, tensors not gathered are the optimizer's own (training on changes them)
    return _to_cpu(named) if to_cpu else named


def model_state(model: nn.Module, *, full: bool, to_cpu: bool, rank0_only: bool,
                fn: str = "get_state_dict") -> dict[str, torch.Tensor]:
    target = _target(model, fn)
    if full and target.sharded is not None:
        return target.sharded.full_state_dict(rank0_only=rank0_only) or {}
    if rank0_only and _rank(target) != 0:
        return {}
    sd = target.module.state_dict()
    return _to_cpu(sd) if to_cpu else sd


def get_state_dict(model: nn.Module, optimizers: Any, *, full_state_dict: bool = False,
                   cpu_offload: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model state dict, optimizer state dict), both keyed by the unwrapped model's names. `full_state_dict`:
    whole tensors (collective over the data-parallel group; the model's on the CPU); else this rank's pieces.
    `cpu_offload`: on the CPU, and with `full_state_dict` on rank 0 only (the other ranks get two empty dicts),
    as torch's `get_state_dict` with `StateDictOptions(full_state_dict=..., cpu_offload=...)`.

    A torch optimizer over `fully_shard`ed parameters holds, per parameter, state laid out like this rank's piece
    of it, keyed by index: `optimizer.state_dict()` cannot be loaded at another world size. Here the optimizer
    state is keyed by parameter name (FQN, the unwrapped model's, as torch's): {"state": {fqn: {"step": tensor [],
    "exp_avg": ...}}, "param_groups": [{"lr": ..., "params": [fqn, ...]}]}. Full: every state tensor shaped like
    its parameter's piece is gathered to the parameter's whole shape (one all-gather per flat and state key),
    scalar state (step) as it is; loading keeps each rank's part. Sharded: this rank's pieces, for a world of the
    same size and wrapping. How a parameter is cut over the ranks is known only to `module.full_tensors` /
    `module.rank_piece`, the pair the model's own `full_state_dict()` uses. Replicated models (DDP, an unwrapped
    module) need no communication."""
    rank0_only = full_state_dict and cpu_offload
    model_sd = model_state(model, full=full_state_dict, to_cpu=cpu_offload, rank0_only=rank0_only)
    optim_sd = optim_state(model, optimizers, full=full_state_dict, to_cpu=cpu_offload, rank0_only=rank0_only)
    return model_sd, optim_sd


# -- setting ---------------------------------------------------------------------------------------

def _check_keys(given: Iterable[str], wanted: Iterable[str], what: str, fn: str) -> None:
    given, wanted = set(given), list(wanted)
    missing = [k for k in wanted if k not in given]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f'{fn}: {what} lacks "{missing[0]}"{more}; give the state dict saved from this model (and '
                        f"its optimizer)")
    extra = sorted(given - set(wanted))
    if extra:
        raise UserError(f'{fn}: {what} has "{extra[0]}", a key this model does not have; give the state dict '
                        f"saved from this model (and its optimizer)")


@torch.no_grad()
def _local_state(target: _Target, fqn: str, p: torch.Tensor, saved: dict[str, Any], *, full: bool,
                 fn: str) -> dict[str, Any]:
    """One parameter's saved state as its optimizer holds it here: a whole tensor cut to this rank's part. Copies:
    `load_state_dict` keeps tensors that need no cast, and training on would change the caller's dict."""
    flat, i = target.where().get(id(p), (None, 0)) if full else (None, 0)
    out = {}
    for key, value in saved.items():
        if is_dtensor(value):           # a sharded state dict's piece, or a whole one placed otherwise
            value = value.full_tensor() if full else _optim_rows(target, p, value)
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
            continue
        here = local_of(p)                  # a DTensor parameter: its rows
        shape = tuple(flat.shapes[i]) if flat is not None else tuple(here.shape)
        if tuple(value.shape) != shape:
            hint = ("" if full or target.sharded is None else
                    "; a sharded state dict loads only at the world size it was saved at, else save and load with "
                    "full_state_dict=True")
            raise UserError(f'{fn}: optimizer state "{fqn}" "{key}" has shape {tuple(value.shape)}, its '
                            f"parameter {shape}{hint}")
        # (a view of the whole tensor would also keep all of it alive in the optimizer)
        out[key] = (rank_piece(flat, i, value) if flat is not None else value).clone()
        if is_dtensor(p):       # the optimizer steps the DTensor parameter: its state is one too, over the rows
            assert target.sharded is not None       # only fully_shard's parameters are DTensors here
            shown_flat, j = target.where()[id(p)]
            out[key] = to_dtensor(target.sharded._fully_shard_state(), shown_flat, j, out[key].to(here.device))
    return out


def _optim_rows(target: _Target, p: torch.Tensor, value: Any) -> torch.Tensor:
    if target.sharded is None:
        return value.full_tensor()
    flat, i = target.where()[id(p)]
    return to_local(target.sharded._fully_shard_state(), flat, i, value)


def optim_state_to_load(model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any], *, full: bool,
                        groups: list[dict] | None = None, fn: str = "set_state_dict") -> dict[str, Any]:
    """A FQN-keyed optimizer state dict (full or this rank's pieces) as `optim.load_state_dict` takes it here:
    keyed by index, each whole tensor cut to this rank's part. `groups`: the saved param groups that are this
    optimizer's (default: all of them). Not collective."""
    if not isinstance(osd, dict) or STATE not in osd or GROUPS not in osd:
        raise UserError(f'{fn}: the optimizer state dict needs "{STATE}" and "{GROUPS}" (keyed by parameter '
                        f"name, as get_state_dict gives it)")
    target = _target(model, fn)
    target.reshard()
    names = _param_names(target, optim, fn)
    groups = osd[GROUPS] if groups is None else groups
    _check_keys([n for g in groups for n in g[PARAMS]], names, "the optimizer state dict's param_groups", fn)
    if len(groups) != len(optim.param_groups):
        raise UserError(f"{fn}: the optimizer state dict has {len(groups)} param groups, the optimizer "
                        f"{len(optim.param_groups)}; give the state dict saved with this optimizer")
    index = {n: k for k, n in enumerate(names)}
    out_groups, start = [], 0
    for saved, live in zip(groups, optim.param_groups):
        # torch's load_state_dict pairs saved and live parameters by position: list them in the live order
        ids = list(range(start, start + len(live[PARAMS])))
        start += len(ids)
        if set(saved[PARAMS]) != {names[k] for k in ids}:
            odd = sorted(set(saved[PARAMS]) ^ {names[k] for k in ids})[0]
            raise UserError(f'{fn}: "{odd}" is in another param group of the optimizer state dict than of the '
                            f"optimizer; give the state dict saved with this optimizer")
        out_groups.append({**saved, PARAMS: ids})
    params = [p for g in optim.param_groups for p in g[PARAMS]]
    listed = {n for g in osd[GROUPS] for n in g[PARAMS]}
    state = {}
    for fqn, saved_state in osd[STATE].items():
        if fqn in index:
            state[index[fqn]] = _local_state(target, fqn, params[index[fqn]], saved_state, full=full, fn=fn)
        elif fqn not in listed:                  # (listed elsewhere: another optimizer's parameter)
            raise UserError(f'{fn}: the optimizer state dict has state for "{fqn}", which no param group lists; '
                            f"give the state dict saved from this model")
    return {STATE: state, GROUPS: out_groups}


def set_state_dict(model: nn.Module, optimizers: Any, *, model_state_dict: dict[str, torch.Tensor] | None,
                   optim_state_dict: dict[str, Any] | None, full_state_dict: bool = False,
                   broadcast_from_rank0: bool = False) -> None:
    """Load what `get_state_dict` gave (None skips a part). `full_state_dict=True`: whole tensors, saved at any
    world size, given on every rank; each rank keeps its part. Else this rank's pieces (DTensors, or plain rows
    saved at this world size and wrapping). Not collective, except `broadcast_from_rank0=True` (with
    `full_state_dict`): only the data-parallel group's rank 0 gives the dicts, the others pass empty ones, and
    rank 0 sends them (`from_rank0.py`). A state dict of another model is refused naming the first key that
    differs."""
    fn = "set_state_dict"
    target = _target(model, fn)
    if broadcast_from_rank0:
        if not full_state_dict:
            raise UserError(f"{fn}: broadcast_from_rank0=True sends whole tensors from rank 0; give "
                            f"full_state_dict=True as well")
        model_state_dict, optim_state_dict = from_rank0(dp_comm(model, target),
                                                        [model_state_dict, optim_state_dict])
    loads = []
    if optim_state_dict is not None:     # every check before anything loads: a refused call changes nothing
        optims = _optimizers(optimizers)
        saved_groups = list(optim_state_dict.get(GROUPS, [])) if isinstance(optim_state_dict, dict) else []
        if len(saved_groups) != sum(len(o.param_groups) for o in optims):
            raise UserError(f"{fn}: the optimizer state dict has {len(saved_groups)} param groups, the optimizers "
                            f"{sum(len(o.param_groups) for o in optims)}; give the state dict saved with them")
        start = 0
        for optim in optims:         # the saved groups follow the optimizers' order, as get_state_dict lists them
            groups = saved_groups[start:start + len(optim.param_groups)]
            start += len(groups)
            loads.append((optim, optim_state_to_load(model, optim, optim_state_dict, full=full_state_dict,
                                                     groups=groups, fn=fn)))
    if model_state_dict is not None:
        load_model_state(target, model_state_dict, full=full_state_dict, fn=fn)
    for optim, osd in loads:
        optim.load_state_dict(osd)


@torch.no_grad()
def load_model_state(target: _Target, sd: dict[str, torch.Tensor], *, full: bool, fn: str) -> None:
    """Checks every key and shape, then loads (whole tensors: each rank keeps its part; DTensors: their rows)."""
    if target.sharded is not None:
        sharding = target.sharded._fully_shard_state()
        with plain_state_dicts(sharding):
            here = target.module.state_dict()
        if not full:                # shapes are checked on this rank's rows (the caller's dict is left as it is)
            sd = dict(sd)
            rows_of(sharding, target.module, sd)
    else:
        here = target.module.state_dict()
    _check_keys(sd.keys(), here.keys(), "the model state dict", fn)
    shapes = {k: tuple(v.shape) for k, v in here.items()}
    if full and target.sharded is not None:
        where = target.where()
        for name, p in target.module.named_parameters(remove_duplicate=False):
            if id(p) in where and name in shapes:
                flat, i = where[id(p)]
                shapes[name] = tuple(flat.shapes[i])
    for k, shape in shapes.items():
        if tuple(sd[k].shape) != shape:
            hint = ("" if full or target.sharded is None else "; a sharded state dict loads only at the world "
                    "size it was saved at, else save and load with full_state_dict=True")
            raise UserError(f'{fn}: "{k}" has shape {tuple(sd[k].shape)}, the model here {shape}{hint}')
    if full and target.sharded is not None:
        target.sharded.load_full_state_dict(sd)
    else:
        target.module.load_state_dict(sd)
