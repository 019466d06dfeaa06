"""DeepSpeed's `deepspeed.utils` tensor-fragment API (`shardwise.utils`): a trained parameter's fp32 value, gradient
and optimizer state, whole or as this rank holds them, read and written under every ZeRO stage.

    safe_get_full_fp32_param(p)             / safe_set_full_fp32_param(p, value)
    safe_get_full_grad(p)                   / safe_set_full_grad(p, value)
    safe_get_full_optimizer_state(p, key)   / safe_set_full_optimizer_state(p, value, key)
    safe_get_local_fp32_param(p)            / safe_set_local_fp32_param(p, value)
    safe_get_local_grad(p)                  / safe_set_local_grad(p, value)
    safe_get_local_optimizer_state(p, key)  / safe_set_local_optimizer_state(p, value, key)
    safe_update_full_grad_vectorized(params, fn)

Each parameter finds the updater that steps it (`link_params`), and through it the stepped tensors (whole, or this
rank's ZeRO shards) and where each piece of the parameter sits in them (`ShardedState.entries`). The full getters
are collective over the data-parallel group when its ranks hold shards (ZeRO 1-3): every dp rank calls them, for
the same parameters in the same order; the setters and the local functions are not. "Full" means the parameter
this rank holds: under tensor parallelism its TP slice (as DeepSpeed's, which assemble over dp only).

When: gradients after the backward of the last micro-batch of a global batch and before `engine.step()` (which
consumes and zeroes them); optimizer states after the first step (Adam's `exp_avg`, `exp_avg_sq`); a value set is
what the next step starts from (a model parameter with separate fp32 masters takes it at that step, as in DeepSpeed).

"Local" is the elements of the parameter (flattened) that this rank's stepped tensors hold, in order: the whole
parameter at stage 0, this rank's piece at stages 1-3, which may be empty. Differences from DeepSpeed: its local
functions exist at stage 3 only and give `ceil(numel / dp)` elements per rank, padded (`ds_tensor`); shardwise's
pieces follow its own shard layout (a unit's flat at stage 3, a bucket's at 1-2), so sizes differ per rank and a
script sizes a local value from what the local getter returns. A local fp32 write is this rank's alone: where
the master is a view of the model's fp32 parameter (ZeRO 1-2 without separate masters) this rank's elements of the
model change at once, the other ranks' at the next step's gather. DeepSpeed gives no fp32 value under stage 0 in fp32
or fp16 (no fp32 mapping exists there); shardwise gives the parameter's. Under `offload_optimizer` the step reads
the gradient copied to the host during backward, so a gradient set after backward does not reach that step.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from shardwise.errors import UserError

if TYPE_CHECKING:
    from shardwise.parallel.interfaces import Piece, UpdateStrategy

UPDATER_ATTR = "_shardwise_updater"
"""Attribute of each trained model parameter: the updater that steps it (set by `link_params`)."""

_PIECES: weakref.WeakKeyDictionary[object, dict[int, list[tuple[int, Piece]]]] = weakref.WeakKeyDictionary()
"""Per updater: id(model parameter) -> [(stepped tensor index, piece)], built once (the layout is fixed)."""


def link_params(updater: UpdateStrategy) -> None:
    """Point every parameter `updater` trains at it, so the functions here find their master and gradient."""
    for p in updater.model_params:
        setattr(p, UPDATER_ATTR, updater)


def _updater(param: torch.nn.Parameter) -> UpdateStrategy | None:
    return getattr(param, UPDATER_ATTR, None)


def _pieces(updater: UpdateStrategy, param: torch.nn.Parameter) -> list[tuple[int, Piece]]:
    """Where `param`'s elements sit in the stepped tensors this rank holds, in parameter order."""
    table = _PIECES.get(updater)
    if table is None:
        table = {}
        for k, entry in enumerate(updater.entries()):
            for piece in entry.pieces:
                table.setdefault(id(piece.param), []).append((k, piece))
        for found in table.values():
            found.sort(key=lambda kp: kp[1].lo)
        _PIECES[updater] = table
    return table.get(id(param), [])


def _numel(param: torch.nn.Parameter, updater: UpdateStrategy) -> tuple[tuple[int, ...], int]:
    """The shape and element count of the parameter as this rank trains it whole (its TP slice)."""
    shape = updater.full_shape(param)
    return shape, math.prod(shape)


# -- the tensors behind each kind of value ----------------------------------------------------------------------

def _masters(updater: UpdateStrategy) -> list[torch.Tensor | None]:
    return list(updater.stepped)


def _grads(updater: UpdateStrategy) -> list[torch.Tensor | None]:
    return updater.stepped_grads()


def _states(updater: UpdateStrategy, key: str) -> list[torch.Tensor | None]:
    """Optimizer state `key` of every stepped tensor; refused in one line before the first step or for a key the
    optimizer does not keep (the check reads every rank's same optimizer, so all ranks agree)."""
    state = updater.optimizer.state
    known = sorted({k for s in state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
    if key not in known:
        when = ("it has none before the first engine.step()" if not known
                else f"per-element states are {', '.join(known)}")
        raise UserError(f"optimizer state {key!r}: the optimizer keeps no such per-element state ({when})")
    return [state[t].get(key) if t in state else None for t in updater.stepped]


# -- full values ------------------------------------------------------------------------------------------------

@torch.no_grad()
def _get_full(param: torch.nn.Parameter, sources: Callable[[UpdateStrategy], list[torch.Tensor | None]]
              ) -> torch.Tensor | None:
    """The whole value [shape] fp32: each rank writes its pieces into zeros, one sum over the shard holders."""
    updater = _updater(param)
    if updater is None:
        return None
    pieces = _pieces(updater, param)
    shape, numel = _numel(param, updater)
    tensors = sources(updater)
    held = [t for t in tensors if t is not None]
    device = held[0].device if held else param.device
    out = torch.zeros(numel, dtype=torch.float32, device=device)
    for k, piece in pieces:
        t = tensors[k]
        if t is not None:
            out[piece.lo:piece.hi] = t.detach().reshape(-1)[piece.dst:piece.dst + piece.hi - piece.lo]
    updater.sum_over_shards(out, param)
    return out.view(shape)


@torch.no_grad()
def _set_full(param: torch.nn.Parameter, value: torch.Tensor,
              sources: Callable[[UpdateStrategy], list[torch.Tensor | None]], what: str) -> None:
    """Write this rank's pieces of the whole `value` into the stepped tensors (every rank passes the same value)."""
    updater = _updater(param)
    if updater is None:
        return
    pieces = _pieces(updater, param)
    shape, numel = _numel(param, updater)
    if value.numel() != numel:
        raise UserError(f"{what}: the value has {value.numel()} elements, the parameter {numel} "
                        f"(shape {list(shape)}): give a tensor of the parameter's shape")
    flat = value.detach().reshape(-1)
    tensors = sources(updater)
    for k, piece in pieces:
        t = tensors[k]
        if t is None:
            raise UserError(f"{what}: the parameter has no gradient yet: call it after the backward of a global "
                            f"batch's last micro-batch and before engine.step()")
        t.reshape(-1)[piece.dst:piece.dst + piece.hi - piece.lo].copy_(flat[piece.lo:piece.hi])
    if param.numel() == numel and any(_shares_storage(t, param) for t in tensors):
        # The stepped tensors are views of the model's parameters (fp32 without separate masters; ZeRO 1-2: this
        # rank's shard of a bucket's flat, which holds the parameter whole, also on a rank holding none of its
        # elements): the whole parameter takes the value, so no rank's model holds a mix of old and new.
        param.detach().copy_(value.detach().reshape(param.shape))


def _shares_storage(t: torch.Tensor | None, param: torch.nn.Parameter) -> bool:
    return t is not None and t.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """A copy of `param`'s fp32 master value; None when no optimizer steps it (frozen, or not in the
    model_parameters given to `shardwise.initialize`), as in DeepSpeed."""
    return _get_full(param, _masters)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set `param`'s fp32 master to `value` (its shape); nothing for a parameter no optimizer steps."""
    _set_full(param, value, _masters, "safe_set_full_fp32_param")


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """`param`'s whole gradient as the next step reads it: fp32 assembled from the gradient shards under ZeRO, a
    copy of the dp-averaged `.grad` otherwise; None when it has none. Under fp16 it is still multiplied by the loss
    scale (the step unscales it), as DeepSpeed's is."""
    updater = _updater(param)
    if updater is None:
        return param.grad    # DeepSpeed's fallback for a parameter it does not manage
    return updater.full_grad(param)


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the gradient the next step reads for `param` (whole `value`; scaled by the loss scale under fp16)."""
    if _updater(param) is None:
        if param.grad is not None:
            param.grad.copy_(value)
        return
    _set_full(param, value, _grads, "safe_set_full_grad")


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """`param`'s whole fp32 optimizer state `optim_state_key` (Adam: "exp_avg", "exp_avg_sq")."""
    return _get_full(param, lambda u: _states(u, optim_state_key))


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set `param`'s optimizer state `optim_state_key` to the whole `value`."""
    _set_full(param, value, lambda u: _states(u, optim_state_key), "safe_set_full_optimizer_state")


def safe_update_full_grad_vectorized(param_list: Iterable[torch.nn.Parameter],
                                     update_func: Callable[[torch.Tensor | None, torch.nn.Parameter], torch.Tensor]
                                     ) -> None:
    """Replace each parameter's whole gradient g by `update_func(g, param)`. Collective like the full getters."""
    for p in param_list:
        if p.requires_grad:
            safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))


# -- local values -----------------------------------------------------------------------------------------------

@torch.no_grad()
def _get_local(param: torch.nn.Parameter, sources: Callable[[UpdateStrategy], list[torch.Tensor | None]]
               ) -> torch.Tensor | None:
    """This rank's elements of `param` [n] fp32, in parameter order; None for a parameter no optimizer steps."""
    updater = _updater(param)
    if updater is None:
        return None
    tensors = sources(updater)
    parts = []
    for k, piece in _pieces(updater, param):
        t = tensors[k]
        if t is None:
            return None
        parts.append(t.detach().reshape(-1)[piece.dst:piece.dst + piece.hi - piece.lo])
    if not parts:
        held = [t for t in tensors if t is not None]
        return torch.zeros(0, dtype=torch.float32, device=held[0].device if held else param.device)
    return torch.cat(parts).to(torch.float32)


@torch.no_grad()
def _set_local(param: torch.nn.Parameter, value: torch.Tensor,
               sources: Callable[[UpdateStrategy], list[torch.Tensor | None]], what: str) -> None:
    updater = _updater(param)
    if updater is None:
        return
    pieces = _pieces(updater, param)
    held = sum(piece.hi - piece.lo for _, piece in pieces)
    if value.numel() != held:
        raise UserError(f"{what}: the value has {value.numel()} elements, this rank holds {held} of the parameter: "
                        f"size it as the matching safe_get_local_* returns")
    flat, at = value.detach().reshape(-1), 0
    tensors = sources(updater)
    for k, piece in pieces:
        t = tensors[k]
        if t is None:
            raise UserError(f"{what}: the parameter has no gradient yet: call it after the backward of a global "
                            f"batch's last micro-batch and before engine.step()")
        n = piece.hi - piece.lo
        t.reshape(-1)[piece.dst:piece.dst + n].copy_(flat[at:at + n])
        at += n


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of `param`'s fp32 master, flattened."""
    return _get_local(param, _masters)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's elements of `param`'s fp32 master (as many as `safe_get_local_fp32_param` gives)."""
    _set_local(param, value, _masters, "safe_set_local_fp32_param")


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of the gradient the next step reads for `param`, flattened, fp32."""
    return _get_local(param, _grads)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's elements of the gradient the next step reads for `param`."""
    _set_local(param, value, _grads, "safe_set_local_grad")


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's elements of `param`'s optimizer state `optim_state_key`, flattened."""
    return _get_local(param, lambda u: _states(u, optim_state_key))


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's elements of `param`'s optimizer state `optim_state_key`."""
    _set_local(param, value, lambda u: _states(u, optim_state_key), "safe_set_local_optimizer_state")
