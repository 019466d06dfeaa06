"""A checkpoint's layout-independent index: where each tensor of the full model lives in the tag's files.

DeepSpeed's files hold what each rank holds: TP slices in `mp_rank_MM_*` files, ZeRO shards (flat, padded
buckets of several parameters) in `zero_pp_rank_D_*` files. Read at another (dp, tp, pp, ZeRO stage), a rank
needs parts of many files; DeepSpeed first needs an offline `ds_to_universal` pass. Every save here also writes

    TAG/shardwise_index.pt      world rank 0; plain dicts, tuples and numbers (loads with weights_only=True)

    "dims":      {"dp": D, "tp": T, "pp": P} of the writer
    "tensors":   {full name: (full shape, TP split dim or None)}   every module tensor (parameters, buffers)
    "module":    {full name: {tp rank: model-states file}}         files holding its value (TP slice)
    "entries":   [(file, key, optimizer index, master index or None, numel, group options)]
                 one per stepped tensor (a ZeRO shard master, or one whole parameter at stage 0);
                 `file[key]` is the updater's state dict (`Update.state_dict`)
    "fragments": {full name: [(tp rank, lo, hi, entry, dst)]}
                 elements [lo, hi) of that TP rank's slice, flattened, are entry's [dst, dst + hi - lo)

A loader reads the index, then memory-maps only the files holding what it needs and copies only the
fragments overlapping its own pieces (`checkpoint_reshard`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shardwise.checkpoint import files as ckpt
from shardwise.parallel.tensor_parallel.layers import TP_DIM_ATTR
from shardwise.comm.topology import Axis

if TYPE_CHECKING:
    from shardwise.checkpoint.context import CheckpointContext

INDEX = "shardwise_index.pt"
VERSION = 1


def _full_shape(local: tuple[int, ...], dim: int | None, tp: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(local)
    return tuple(n * tp if d == dim else n for d, n in enumerate(local))


def rank_contribution(ctx: CheckpointContext, where: dict[str, int], *, as_writer: bool = False) -> dict[str, Any]:
    """What this rank's files hold, under the full model's names (the index before merging). `as_writer`: also
    on a dp rank other than 0, what it would write of the model states (what it reads back at this layout)."""
    tp, tp_rank = where["tp_size"], where["tp_rank"]
    names = ctx.naming.full_names(ctx.module)
    own = ctx.module.state_dict(keep_vars=True)
    state = ctx.state
    stepped = state.entries()
    local_shape = {id(p.param): p.shape for e in stepped for p in e.pieces}
    writes_model = ctx.dp_rank == 0 or as_writer
    model_file = ckpt.model_states_name(where["mp_rank"])
    tensors: dict[str, tuple] = {}
    module: dict[str, dict[int, str]] = {}
    for local, t in own.items():
        full, dim = names[local], getattr(t, TP_DIM_ATTR, None)
        # A ZeRO-3 parameter between uses is an empty placeholder: its shape comes from its pieces.
        shape = tuple(t.shape) if t.numel() > 0 else local_shape.get(id(t))
        if shape is not None:
            tensors[full] = (_full_shape(shape, dim, tp), dim)
        if writes_model and t.numel() > 0:
            module[full] = {tp_rank: model_file}
    entries: list[tuple] = []
    fragments: dict[str, list[tuple]] = {}
    if state.checkpoint_per_rank or writes_model:
        file, key = ((ckpt.optim_states_name(ctx.dp_rank, where["mp_rank"]), "optimizer_state_dict")
                     if state.checkpoint_per_rank else (model_file, "optimizer"))
        param_name = {id(p): names[n] for n, p in ctx.module.named_parameters()}
        for k, (e, t) in enumerate(zip(stepped, state.stepped)):
            entries.append((file, key, e.optimizer_index, e.master_index, t.numel(), e.options))
            for p in e.pieces:
                fragments.setdefault(param_name[id(p.param)], []).append((tp_rank, p.lo, p.hi, k, p.dst))
    return {"tensors": tensors, "module": module, "entries": entries, "fragments": fragments}


def gather_index(ctx: CheckpointContext, contribution: dict[str, Any]) -> dict[str, Any] | None:
    """Every rank's contribution merged into the index, on world rank 0 (None elsewhere). Collective: the
    contributions travel over dp, then tp, then pp, so after the three every rank's has arrived."""
    parts = [contribution]
    for axis in (Axis.DP, Axis.TP, Axis.PP):
        comm = ctx.comm(axis)
        parts = [p for group in comm.all_gather_object(parts) for p in group]
    if ctx.mesh.global_rank != 0:
        return None
    mesh = ctx.mesh
    index: dict[str, Any] = {"version": VERSION, "tensors": {}, "module": {}, "entries": [], "fragments": {},
                             "dims": {"dp": mesh.size(Axis.DP), "tp": mesh.size(Axis.TP), "pp": mesh.size(Axis.PP)}}
    for part in parts:
        base = len(index["entries"])
        index["entries"] += part["entries"]
        index["tensors"].update(part["tensors"])
        for name, files in part["module"].items():
            index["module"].setdefault(name, {}).update(files)
        for name, frags in part["fragments"].items():
            index["fragments"].setdefault(name, []).extend(
                (t, lo, hi, base + entry, dst) for t, lo, hi, entry, dst in frags)
    return index


def read_index(path) -> dict[str, Any] | None:
    """The tag's index, or None for a checkpoint written before indexes existed."""
    file = path / INDEX
    if not file.is_file():
        return None
    try:
        index = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader error means the same thing to the user
        raise ckpt.CheckpointError(f"checkpoint file {file} is truncated or corrupt "
                                   f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                                   f"restore it or load another tag") from None
    if not isinstance(index, dict) or index.get("version") != VERSION:
        raise ckpt.CheckpointError(f"checkpoint file {file} has index version {index.get('version')!r}; this "
                                   f"shardwise reads version {VERSION}: load it with the shardwise that wrote it")
    return index


def covered(frags: list[tuple], tp_rank: int, numel: int) -> bool:
    """Whether the fragments of `tp_rank` cover a TP slice of `numel` elements."""
    runs = sorted((lo, hi) for t, lo, hi, _, _ in frags if t == tp_rank)
    end = 0
    for lo, hi in runs:
        if lo > end:
            return False
        end = max(end, hi)
    return end >= numel


def same_layout(index: dict[str, Any], mine: dict[str, Any], dims: dict[str, int]) -> bool:
    """Whether the files this rank reads at its own layout hold exactly its pieces (`mine`, a
    `rank_contribution(as_writer=True)`): the same dims, stepped tensors and fragments. Then it reads them as
    they are, as before indexes existed."""
    if index["dims"] != dims:
        return False
    files = {e[0] for e in mine["entries"]}
    saved = [(i, e) for i, e in enumerate(index["entries"]) if e[0] in files]
    if [e[:5] for _, e in saved] != [e[:5] for e in mine["entries"]]:     # options (lr) may have moved
        return False
    local = {i: k for k, (i, _) in enumerate(saved)}
    theirs: dict[str, list[tuple]] = {}
    for name, frags in index["fragments"].items():
        for t, lo, hi, entry, dst in frags:
            if entry in local:
                theirs.setdefault(name, []).append((t, lo, hi, local[entry], dst))
    return {n: sorted(f) for n, f in theirs.items()} == {n: sorted(f) for n, f in mine["fragments"].items()}
