"""A checkpoint's layout-independent index: where each tensor of the full model lives in the tag's files.

DeepSpeed's files hold what each rank holds (TP slices in `mp_rank_MM_*`, flat padded ZeRO shards in
`zero_pp_rank_D_*`), so reading them at another (dp, tp, pp, ZeRO stage) first needs an offline
`ds_to_universal` pass. Every save here also writes TAG/shardwise_index.pt (world rank 0), a `CheckpointIndex`,
last, with the size and CRC-32 of every other file of the tag, a CRC-32 per piece a loader reads through the
memory map (`PieceSums`: per fragment and saved tensor holding it, per module tensor, and per file one over its
pickle and its tensors outside the index) and a CRC-32 of its own contents, so a rank checks exactly what it
reads (`reshard.FileReader`): a rank that reshards, only its pages; one at the writer's layout, whole files.

    index = read_index(tag_dir)     # None for a checkpoint written before indexes; `reshard.py` loads through it

Versions: 1 (no checksums; still read, its files unverified, said once per tag), 2 (file sums: its files are
checked whole) and 3 (also piece sums).
"""

from __future__ import annotations

import reprlib
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint.experts import expert_files
from shardwise.comm.topology import Axis, ParallelMesh
from shardwise.parallel.tensor_parallel.layers import TP_DIM_ATTR

if TYPE_CHECKING:
    from shardwise.checkpoint.context import CheckpointContext

INDEX = "shardwise_index.pt"
VERSION = 3
READS = (1, 2, 3)
"""Index versions this shardwise reads: 1 has no checksums, 2 no piece sums."""
NATIVE_STAGE0_KEY = "shardwise_optimizer"
"""Where stage 0's model states keep our optimizer state (torch's state dict, the masters, the loss scaler);
DeepSpeed's `optimizer` beside it is torch's state dict alone."""


@dataclass(frozen=True)
class Dims:
    """The sizes of a run's parallel axes: of the run that wrote a checkpoint, or of this one."""

    dp: int
    tp: int
    pp: int

    @classmethod
    def of(cls, mesh: ParallelMesh) -> Dims:
        return cls(dp=mesh.size(Axis.DP), tp=mesh.size(Axis.TP), pp=mesh.size(Axis.PP))

    def __str__(self) -> str:
        return f"dp={self.dp}, tp={self.tp}, pp={self.pp}"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the full model."""

    shape: tuple[int, ...]
    """Its full shape (all TP slices together)."""
    tp_dim: int | None
    """The dim tensor parallelism splits it along; None: every TP rank holds it whole."""


@dataclass(frozen=True)
class IndexEntry:
    """One saved stepped tensor: a ZeRO shard's fp32 master, or one whole parameter at stage 0."""

    file: str
    key: str
    """`file[key]` is the updater's state dict (`ShardedState.state_dict`) holding it."""
    optimizer_index: int
    """Its slot in that state dict's `["optimizer"]["state"]`."""
    master_index: int | None
    """Its slot in `["masters"]`; None: the optimizer steps the parameter itself, whose value the module
    states hold."""
    numel: int
    options: Mapping[str, Any]
    """Its param group's options (lr, betas, ...) when saved."""

    def same_tensor(self, other: IndexEntry) -> bool:
        """Whether both name the same saved tensor: file, slots and size. The options may differ (a scheduler
        moves the lr between saves)."""
        return (self.file, self.key, self.optimizer_index, self.master_index, self.numel) == \
            (other.file, other.key, other.optimizer_index, other.master_index, other.numel)


@dataclass(frozen=True, order=True)
class Fragment:
    """Elements [lo, hi) of TP rank `tp_rank`'s slice of a tensor, flattened, are elements [dst, dst + hi - lo)
    of entry `entry` (its position in `CheckpointIndex.entries`)."""

    tp_rank: int
    lo: int
    hi: int
    entry: int
    dst: int


@dataclass(frozen=True)
class PieceSums:
    """CRC-32s of the pieces of a tag's files a loader reads through the memory map (version 3).

        fragments    {full name: ({saved tensor: CRC-32}, ...)}    one dict per `CheckpointIndex.fragments[name]`
                     item, in its order: the CRC-32 of elements [dst, dst + hi - lo) of each saved tensor holding
                     the fragment ("value": the master or the parameter; "exp_avg", ...: per-element states)
        module       {full name: {tp rank: CRC-32}}                 of the whole module tensor `module` maps
        rest         {file name: CRC-32}                            of the file's pickle record (every Python value,
                     every tensor's dtype, shape and place) and of its tensors the index does not map, but for
                     DeepSpeed's copy of an optimizer shard, which shardwise never reads (`reshard.rest_sum`)

    Each is of the bytes as the file holds them (computed from the written files), so the loader's check is the
    same computation over the same pages.
    """

    fragments: Mapping[str, tuple[Mapping[str, int], ...]] = field(default_factory=dict)
    module: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    rest: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def merged(cls, parts: Sequence[PieceSums]) -> PieceSums:
        """The ranks' sums as one: each rank summed the pieces of the files it wrote ({} for the others)."""
        fragments: dict[str, dict[int, dict[str, int]]] = {}
        module: dict[str, dict[int, int]] = {}
        rest: dict[str, int] = {}
        for part in parts:
            for name, sums in part.fragments.items():
                for j, keyed in enumerate(sums):
                    if keyed:
                        fragments.setdefault(name, {}).setdefault(j, {}).update(keyed)
            for name, by_rank in part.module.items():
                module.setdefault(name, {}).update(by_rank)
            rest.update(part.rest)
        return cls(fragments={n: tuple(by_j.get(j, {}) for j in range(max(by_j) + 1))
                              for n, by_j in fragments.items()}, module=module, rest=rest)


@dataclass(frozen=True)
class CheckpointIndex:
    """Where each tensor of the full model lives in a tag's files.

        dims         the writer's `Dims` (dp, tp, pp)
        tensors      {full name: TensorInfo(full shape, TP split dim or None)}  every module tensor (params, buffers)
        module       {full name: {tp rank: model-states file}}                  files holding its value (TP slice)
        entries      [IndexEntry(file, key, optimizer index, master index, numel, options)]
                     one per stepped tensor (a ZeRO shard master, or one whole parameter at stage 0)
        fragments    {full name: [Fragment(tp rank, lo, hi, entry, dst)]}
                     elements [lo, hi) of that TP rank's slice, flattened, are entry's [dst, dst + hi - lo)
        checksums    {file name: FileSum(size, CRC-32)}                      every file of the tag but the index;
                     empty for a version-1 index (and before the save wrote the files)
        pieces       `PieceSums`, or None before version 3

    A loader reads the index, then memory-maps only the files holding what it needs and copies only the fragments
    overlapping its own pieces (`reshard.py`).
    """

    dims: Dims
    tensors: Mapping[str, TensorInfo]
    module: Mapping[str, Mapping[int, str]]
    entries: tuple[IndexEntry, ...]
    fragments: Mapping[str, tuple[Fragment, ...]]
    checksums: Mapping[str, ckpt.FileSum] = field(default_factory=dict)
    pieces: PieceSums | None = None

    @classmethod
    def merged(cls, parts: Sequence[CheckpointIndex]) -> CheckpointIndex:
        """The ranks' contributions as one index: entries concatenated in order, the fragments' entry numbers
        shifted to match. The dims are the first part's (every rank of a run has the same)."""
        tensors: dict[str, TensorInfo] = {}
        module: dict[str, dict[int, str]] = {}
        entries: list[IndexEntry] = []
        fragments: dict[str, list[Fragment]] = {}
        for part in parts:
            base = len(entries)
            entries += part.entries
            tensors.update(part.tensors)
            for name, files in part.module.items():
                module.setdefault(name, {}).update(files)
            for name, frags in part.fragments.items():
                fragments.setdefault(name, []).extend(
                    Fragment(f.tp_rank, f.lo, f.hi, base + f.entry, f.dst) for f in frags)
        return cls(dims=parts[0].dims, tensors=tensors, module=module, entries=tuple(entries),
                   fragments={n: tuple(f) for n, f in fragments.items()})

    def to_dict(self) -> dict[str, Any]:
        """The layout part of the stored form, as version 1 stored it: plain dicts, tuples and numbers, which
        `weights_only=True` loads. A save writes it `sealed` with the files' checksums (version 2)."""
        return {"version": 1,
                "tensors": {n: (tuple(t.shape), t.tp_dim) for n, t in self.tensors.items()},
                "module": {n: dict(files) for n, files in self.module.items()},
                "entries": [(e.file, e.key, e.optimizer_index, e.master_index, e.numel, dict(e.options))
                            for e in self.entries],
                "fragments": {n: [(f.tp_rank, f.lo, f.hi, f.entry, f.dst) for f in frags]
                              for n, frags in self.fragments.items()},
                "dims": {"dp": self.dims.dp, "tp": self.dims.tp, "pp": self.dims.pp}}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> CheckpointIndex:
        """The index `to_dict` stored (its version checked by the caller). Raises `DamagedIndex` saying what is
        wrong when a key is missing, a value has the wrong type, or a fragment names an entry or TP rank the
        index does not have."""
        _need(raw, ("dims", "tensors", "module", "entries", "fragments"), "the index")
        d = _need(raw["dims"], ("dp", "tp", "pp"), "'dims'")
        dims = Dims(**{k: _int(d[k], f"'dims'[{k!r}]", minimum=1) for k in ("dp", "tp", "pp")})
        tensors: dict[str, TensorInfo] = {}
        for name, value in _dict(raw["tensors"], "'tensors'").items():
            where = f"'tensors'[{_show(name)}]"
            shape, dim = _record(value, where, ("full shape", "TP dim"))
            shape = tuple(_int(n, f"{where} shape") for n in _record(shape, f"{where} shape"))
            tensors[_str(name, where)] = TensorInfo(shape, None if dim is None else _int(dim, f"{where} TP dim"))
        module: dict[str, dict[int, str]] = {}
        for name, files in _dict(raw["module"], "'module'").items():
            where = f"'module'[{_show(name)}]"
            module[_str(name, where)] = {_tp_rank(t, where, dims): _str(f, where)
                                         for t, f in _dict(files, where).items()}
        entries: list[IndexEntry] = []
        for i, value in enumerate(_list(raw["entries"], "'entries'")):
            where = f"'entries'[{i}]"
            file, key, opt, master, numel, options = _record(
                value, where, ("file", "key", "optimizer index", "master index", "numel", "options"))
            entries.append(IndexEntry(_str(file, where), _str(key, where), _int(opt, f"{where} optimizer index"),
                                      None if master is None else _int(master, f"{where} master index"),
                                      _int(numel, f"{where} numel"), _dict(options, f"{where} options")))
        fragments: dict[str, tuple[Fragment, ...]] = {}
        for name, frags in _dict(raw["fragments"], "'fragments'").items():
            where = f"'fragments'[{_show(name)}]"
            out: list[Fragment] = []
            for j, value in enumerate(_list(frags, where)):
                at = f"{where}[{j}]"
                t, lo, hi, entry, dst = (_int(x, at) for x in
                                         _record(value, at, ("tp rank", "lo", "hi", "entry", "dst")))
                if not (t < dims.tp and lo <= hi and entry < len(entries)
                        and dst + hi - lo <= entries[entry].numel):
                    raise DamagedIndex(f"{at} = {_show(value)} names no TP rank, run or entry of the index")
                out.append(Fragment(t, lo, hi, entry, dst))
            fragments[_str(name, where)] = tuple(out)
        checksums: dict[str, ckpt.FileSum] = {}
        for name, value in _dict(raw.get("checksums", {}), "'checksums'").items():
            where = f"'checksums'[{_show(name)}]"
            size, crc = _record(value, where, ("size", "CRC-32"))
            checksums[_str(name, where)] = ckpt.FileSum(_int(size, f"{where} size"), _int(crc, f"{where} CRC-32"))
        pieces = _piece_sums(raw, fragments) if "rest_crc32" in raw else None
        return cls(dims=dims, tensors=tensors, module=module, entries=tuple(entries), fragments=fragments,
                   checksums=checksums, pieces=pieces)


def _piece_sums(raw: Mapping[str, Any], fragments: Mapping[str, tuple[Fragment, ...]]) -> PieceSums:
    """A version-3 index's piece sums, checked as `from_dict` checks the rest."""
    frag_sums: dict[str, tuple[dict[str, int], ...]] = {}
    for name, sums in _dict(raw.get("fragment_crc32", {}), "'fragment_crc32'").items():
        where = f"'fragment_crc32'[{_show(name)}]"
        listed = _list(sums, where)
        if name not in fragments or len(listed) != len(fragments[name]):
            raise DamagedIndex(f"{where} does not match the fragments of that name")
        frag_sums[name] = tuple({_str(k, f"{where}[{j}]"): _int(v, f"{where}[{j}][{_show(k)}]")
                                 for k, v in _dict(keyed, f"{where}[{j}]").items()} for j, keyed in enumerate(listed))
    module: dict[str, dict[int, int]] = {}
    for name, by_rank in _dict(raw.get("module_crc32", {}), "'module_crc32'").items():
        where = f"'module_crc32'[{_show(name)}]"
        module[_str(name, where)] = {_int(t, f"{where} TP rank"): _int(c, f"{where} CRC-32")
                                     for t, c in _dict(by_rank, where).items()}
    rest = {_str(name, "'rest_crc32'"): _int(c, f"'rest_crc32'[{_show(name)}]")
            for name, c in _dict(raw["rest_crc32"], "'rest_crc32'").items()}
    return PieceSums(fragments=frag_sums, module=module, rest=rest)


def _contents_crc(body: Mapping[str, Any]) -> int:
    """CRC-32 of an index's stored contents: of their repr, which plain dicts (in their stored order), tuples,
    strings and numbers give the same after a save and a load."""
    return zlib.crc32(repr(body).encode("utf-8"))


def sealed(index: CheckpointIndex, sums: Mapping[str, ckpt.FileSum], pieces: PieceSums | None = None
           ) -> dict[str, Any]:
    """The stored form: `to_dict` with every file's (size, CRC-32), with `pieces` their piece sums (version 3;
    version 2 without), and a CRC-32 of all that."""
    body = {**index.to_dict(), "version": VERSION if pieces is not None else 2,
            "checksums": {name: (s.size, s.crc32) for name, s in sorted(sums.items())}}
    if pieces is not None:
        body.update({
            # aligned with the fragments: {} for one no rank summed (the loader checks its file whole then)
            "fragment_crc32": {n: [dict(pieces.fragments.get(n, ())[j]) if j < len(pieces.fragments.get(n, ()))
                                   else {} for j in range(len(frags))] for n, frags in index.fragments.items()},
            "module_crc32": {n: dict(by_rank) for n, by_rank in pieces.module.items()},
            "rest_crc32": dict(sorted(pieces.rest.items()))})
    return {**body, "contents_crc32": _contents_crc(body)}


def gather_sums(ctx: CheckpointContext, mine: Mapping[str, ckpt.FileSum], pieces: PieceSums | None = None
                ) -> tuple[dict[str, ckpt.FileSum], PieceSums | None] | None:
    """Every rank's file sums (and piece sums), on world rank 0 (None elsewhere). Collective over dp, tp, pp in
    turn."""
    parts = [(dict(mine), pieces)]
    for axis in (Axis.DP, Axis.TP, Axis.PP):
        parts = [p for group in ctx.comm(axis).all_gather_object(parts) for p in group]
    if ctx.mesh.global_rank != 0:
        return None
    files = {name: ckpt.FileSum(*s) for part, _ in parts for name, s in part.items()}
    given = [p for _, p in parts if p is not None]
    return files, PieceSums.merged(given) if given else None


def sealer(ctx: CheckpointContext, index: CheckpointIndex | None,
           pieces: Callable[[list[str]], PieceSums] | None = None
           ) -> Callable[[dict[str, ckpt.FileSum]], dict[str, Any]]:
    """`files.write_tag`'s `seal`: gathers the sums and, on world rank 0 (which holds `index`), returns the
    sealed index to write. `pieces(names)`: the piece sums of this rank's written files `names`."""
    def seal(sums: dict[str, ckpt.FileSum]) -> dict[str, Any]:
        mine: PieceSums | None = None
        if pieces is not None:
            try:
                mine = pieces(sorted(sums))
            except Exception:  # noqa: BLE001 - every rank must reach the gather (a failed write is agreed after)
                mine = None     # its files then have no piece sums: a loader checks them whole
        every = gather_sums(ctx, sums, mine)
        return {} if every is None or index is None else {INDEX: sealed(index, *every)}
    return seal


class DamagedIndex(ValueError):
    """What is wrong with a stored index, in a few words (`read_index` names the file)."""


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother = 120, 60       # whole tensor names; a short view of anything else


def _show(value: object) -> str:
    return _REPR.repr(value)


def _need(value: object, keys: tuple[str, ...], where: str) -> dict[Any, Any]:
    found = _dict(value, where)
    missing = [k for k in keys if k not in found]
    if missing:
        raise DamagedIndex(f"{where} has no {missing[0]!r}")
    return found


def _dict(value: object, where: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise DamagedIndex(f"{where} is {_show(value)}, not a dict")
    return value


def _list(value: object, where: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise DamagedIndex(f"{where} is {_show(value)}, not a list")
    return value


def _record(value: object, where: str, fields: tuple[str, ...] | None = None) -> tuple[Any, ...]:
    """A tuple (or list) of `fields`; any length when None."""
    if not isinstance(value, (list, tuple)) or (fields is not None and len(value) != len(fields)):
        what = f"({', '.join(fields)})" if fields is not None else "a tuple"
        raise DamagedIndex(f"{where} is {_show(value)}, not {what}")
    return tuple(value)


def _int(value: object, where: str, *, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise DamagedIndex(f"{where} is {_show(value)}, not an integer >= {minimum}")
    return value


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise DamagedIndex(f"{where} holds {_show(value)}, not a name")
    return value


def _tp_rank(value: object, where: str, dims: Dims) -> int:
    t = _int(value, f"{where} TP rank")
    if t >= dims.tp:
        raise DamagedIndex(f"{where} names TP rank {t} of a checkpoint written at {dims}")
    return t


def _full_shape(local: tuple[int, ...], dim: int | None, tp: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(local)
    return tuple(n * tp if d == dim else n for d, n in enumerate(local))


def per_layer(ctx: CheckpointContext, where: dict[str, int]) -> bool:
    """Whether the module states go into one file per pipeline layer, as DeepSpeed's PipelineModule saves them
    (`layer_XX-model_states.pt`, DeepSpeed's PipelineEngine reads nothing else): a pipeline without tensor
    parallelism whose stages hold layers of a layer list ("layers.<i>.<name>": our PipelineModule's)."""
    if where["pp_size"] == 1 or where["tp_size"] > 1:
        return False
    return all(ckpt.layer_file_of(n) is not None for n in ctx.naming.full_names(ctx.module).values())


def rank_contribution(ctx: CheckpointContext, where: dict[str, int], *, as_writer: bool = False,
                      exclude_frozen: bool = False) -> CheckpointIndex:
    """What this rank's files hold, under the full model's names (the index before merging). `as_writer`: also
    on a dp rank other than 0, what it would write of the model states (what it reads back at this layout).
    `exclude_frozen`: the parameters that do not require grad are left out (save_checkpoint's
    exclude_frozen_parameters)."""
    tp, tp_rank = where["tp_size"], where["tp_rank"]
    names = ctx.naming.full_names(ctx.module)
    own = ctx.module.state_dict(keep_vars=True)
    state = ctx.state
    stepped = state.entries()
    local_shape = {id(p.param): p.shape for e in stepped for p in e.pieces}
    writes_model = ctx.dp_rank == 0 or as_writer
    # DeepSpeed's names: at ZeRO-3 every dp rank writes model states; dp rank 0's are the ones indexed.
    model_file = (ckpt.zero3_model_states_name(0, where["mp_rank"]) if ctx.zero_stage == 3 else
                  ckpt.model_states_name(where["mp_rank"]))
    # An MoE model's experts: each in a file of its own, written by the first rank of its expert-dp group.
    experts = expert_files(ctx, where["mp_rank"])
    writes_experts = experts.writer or as_writer
    tensors: dict[str, TensorInfo] = {}
    module: dict[str, dict[int, str]] = {}
    left_out = {id(p) for p in ctx.module.parameters() if not p.requires_grad} if exclude_frozen else set()
    for local, t in own.items():
        if id(t) in left_out:
            continue
        full, dim = names[local], getattr(t, TP_DIM_ATTR, None)
        # A ZeRO-3 parameter between uses is an empty placeholder: its shape comes from its pieces.
        shape = tuple(t.shape) if t.numel() > 0 else local_shape.get(id(t))
        if shape is not None:
            tensors[full] = TensorInfo(_full_shape(shape, dim, tp), dim)
        # At ZeRO-3 a trained parameter's value is its masters' (the model states hold DeepSpeed's placeholder).
        placeholder = ctx.zero_stage == 3 and isinstance(t, torch.nn.Parameter) and t.requires_grad
        if local in experts.files:
            if writes_experts and t.numel() > 0 and not placeholder:
                module[full] = {tp_rank: experts.files[local]}
        elif writes_model and t.numel() > 0 and not placeholder:
            layer = ckpt.layer_file_of(full) if per_layer(ctx, where) else None
            module[full] = {tp_rank: layer[0] if layer is not None else model_file}
    entries: list[IndexEntry] = []
    fragments: dict[str, list[Fragment]] = {}
    if state.checkpoint_per_rank or writes_model or (writes_experts and experts.optim_file is not None):
        shard = ckpt.optim_states_name(ctx.dp_rank, where["mp_rank"], bf16=ctx.bf16)
        file, key = ((shard, ckpt.NATIVE_OPTIMIZER_STATE_DICT) if state.checkpoint_per_rank else
                     (model_file, NATIVE_STAGE0_KEY))
        param_name = {id(p): names[n] for n, p in ctx.module.named_parameters()}
        for e, t in zip(stepped, state.stepped):
            # Without ZeRO an expert's entry is in its ep rank's expert optimizer file, the rest in the model's.
            if experts.optim_file is not None and any(id(p.param) in experts.params for p in e.pieces):
                if not writes_experts:
                    continue
                entries.append(IndexEntry(experts.optim_file, key, e.optimizer_index, e.master_index, t.numel(),
                                          e.options))
            elif state.checkpoint_per_rank or writes_model:
                entries.append(IndexEntry(file, key, e.optimizer_index, e.master_index, t.numel(), e.options))
            else:
                continue
            k = len(entries) - 1
            for p in e.pieces:
                fragments.setdefault(param_name[id(p.param)], []).append(Fragment(tp_rank, p.lo, p.hi, k, p.dst))
    return CheckpointIndex(dims=Dims.of(ctx.mesh), tensors=tensors, module=module, entries=tuple(entries),
                           fragments={n: tuple(f) for n, f in fragments.items()})


def gather_index(ctx: CheckpointContext, contribution: CheckpointIndex, *,
                 everywhere: bool = False) -> CheckpointIndex | None:
    """Every rank's contribution merged into the index, on world rank 0 (None elsewhere unless `everywhere`).
    Collective: the contributions travel over dp, then tp, then pp, so after the three every rank's has
    arrived."""
    parts = [contribution]
    for axis in (Axis.DP, Axis.TP, Axis.PP):
        comm = ctx.comm(axis)
        parts = [p for group in comm.all_gather_object(parts) for p in group]
    if ctx.mesh.global_rank != 0 and not everywhere:
        return None
    return CheckpointIndex.merged(parts)


_unverified: set[Path] = set()     # tags already said to be read without checksums


def _say_unverified(path: Path, why: str) -> None:
    if path not in _unverified:
        _unverified.add(path)
        warnings.warn(f"checkpoint {path} {why}: its files are loaded without checking their checksums",
                      ckpt.CheckpointWarning, stacklevel=3)


def read_index(path: Path) -> CheckpointIndex | None:
    """The tag's index, or None for a checkpoint written before indexes existed. A file that does not load, or
    holds no index this shardwise reads, or whose contents do not match their CRC-32, is one `CheckpointError`
    line naming it."""
    file = path / INDEX
    if not file.is_file():
        return None
    try:
        raw = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader error means the same thing to the user
        raise ckpt.CheckpointError(f"checkpoint file {file} is truncated or corrupt "
                                   f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                                   f"restore it or load another tag") from None
    try:
        version = _dict(raw, "the index").get("version")
        if version not in READS:
            raise ckpt.CheckpointError(f"checkpoint file {file} has index version {version!r}; this shardwise "
                                       f"reads versions {', '.join(map(str, READS))}: load it with the shardwise "
                                       f"that wrote it")
        if version >= 2:
            body = {k: v for k, v in raw.items() if k != "contents_crc32"}
            if raw.get("contents_crc32") != _contents_crc(body):
                raise ckpt.CheckpointError(f"checkpoint file {file} is damaged: its contents do not match their "
                                           f"CRC-32; restore it or load another tag")
        return CheckpointIndex.from_dict(raw)
    except DamagedIndex as e:
        raise ckpt.CheckpointError(f"checkpoint file {file} is a damaged index: {e}; restore it or load another "
                                   f"tag") from None


def read_checksums(path: Path) -> Mapping[str, ckpt.FileSum] | None:
    """The sums of the tag's files from its index; None (said once per tag) when it has none to check against:
    written by DeepSpeed (whose files carry no checksums; `deepspeed_read` builds their index from its metadata),
    or by a shardwise from before indexes or before checksums."""
    index = read_index(path)
    if index is None:
        _say_unverified(path, "has no shardwise layout index (DeepSpeed or an earlier shardwise wrote it)")
        return None
    if not index.checksums:
        _say_unverified(path, "has a version-1 index, without checksums (written by an earlier shardwise)")
        return None
    return index.checksums


def covered(frags: Sequence[Fragment], tp_rank: int, numel: int) -> bool:
    """Whether the fragments of `tp_rank` cover a TP slice of `numel` elements."""
    runs = sorted((f.lo, f.hi) for f in frags if f.tp_rank == tp_rank)
    end = 0
    for lo, hi in runs:
        if lo > end:
            return False
        end = max(end, hi)
    return end >= numel


def same_layout(index: CheckpointIndex, mine: CheckpointIndex) -> bool:
    """Whether the files this rank reads at its own layout hold exactly its pieces (`mine`, a
    `rank_contribution(as_writer=True)`): the same dims, stepped tensors and fragments. Then it reads them as
    they are, as before indexes existed."""
    if index.dims != mine.dims:
        return False
    files = {e.file for e in mine.entries}
    saved = [(i, e) for i, e in enumerate(index.entries) if e.file in files]
    if len(saved) != len(mine.entries) or not all(s.same_tensor(e) for (_, s), e in zip(saved, mine.entries)):
        return False
    local = {i: k for k, (i, _) in enumerate(saved)}
    theirs: dict[str, list[Fragment]] = {}
    for name, frags in index.fragments.items():
        for f in frags:
            if f.entry in local:
                theirs.setdefault(name, []).append(Fragment(f.tp_rank, f.lo, f.hi, local[f.entry], f.dst))
    return {n: sorted(f) for n, f in theirs.items()} == {n: sorted(f) for n, f in mine.fragments.items()}
