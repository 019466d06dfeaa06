"""Load an indexed checkpoint at any (dp, tp, pp, ZeRO stage, offload): each rank assembles its own pieces.

Two phases, so that a checkpoint that cannot be loaded leaves the run untouched:

    plan = Plan(ctx, index, FileReader(tag_dir), strict=True, optimizer=True)   # checks only, changes nothing
    problem = plan.problem or plan.check_reads()                                 # every piece it will read
    agree(ctx, problem)                                                          # the same verdict on every rank
    apply(plan, load_optimizer_states=True)                                      # then writes
"""

from __future__ import annotations

from dataclasses import dataclass
import zipfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint import index as checkpoint_index
from shardwise.checkpoint.index import CheckpointIndex, Fragment, IndexEntry, PieceSums, covered
from shardwise.parallel.tensor_parallel.layers import TP_DIM_ATTR
from shardwise.comm.topology import Axis

if TYPE_CHECKING:
    from shardwise.checkpoint.context import CheckpointContext

_CHUNK_BYTES = 256 << 20   # module tensors assembled at once: a ZeRO-3 rank never holds its whole TP slice
VALUE = "value"          # the stepped tensor's value (fp32 master, or the parameter itself)
RUN_OWN_OPTIONS = frozenset({"initial_lr", "foreach", "fused", "capturable", "differentiable"})
"""Param-group options each run keeps as its own: torch's kernel choice and the scheduler's bookkeeping, not the
arithmetic (DeepSpeed's optimizer has no `initial_lr` and builds torch's Adam with fused=None)."""


class FileReader:
    """The tag's files, each loaded once (memory-mapped unless `mmap=False`: tensors are then read on first use),
    each checked against the sums its index recorded (or `sums`, when given: {name: FileSum}; {}: nothing checked);
    a missing or damaged file is one `CheckpointError` naming it.

    Memory-mapped with a version-3 index, a file is checked piece by piece, for exactly what is read: its size and
    its `rest_sum` when it opens, then each fragment and module tensor the first time an `Assembler` reads it
    (`check_fragment`, `check_module`), so a rank that reshards reads only its own pages. Otherwise, and for a piece
    the index has no sum for, the whole file's CRC-32 is checked. `bytes_checked`: the bytes read to check."""

    def __init__(self, path: Path, *, mmap: bool = True, sums: Mapping[str, ckpt.FileSum] | None = None):
        self.path = path
        self.mmap = mmap
        self.head = ckpt.head_name(path) or ckpt.MODEL_STATES
        """The model-states file holding the counters, config and client state."""
        self._open: dict[str, Any] = {}
        self._sums = sums
        self._index: CheckpointIndex | None = None
        """The index whose piece sums are checked (a version-3 index, memory-mapped reading); else None."""
        self._piecewise: set[str] = set()      # files opened for piece checks
        self._checked: set[tuple[str, int, str]] = set()
        self._whole: set[str] = set()          # files checked whole
        self.bytes_checked = 0

    def _read_sums(self) -> None:
        if self._sums is not None:
            return
        self._sums = checkpoint_index.read_checksums(self.path) or {}
        if self._sums and self.mmap:
            index = checkpoint_index.read_index(self.path)
            self._index = index if index is not None and index.pieces is not None else None

    def __call__(self, name: str) -> Any:
        if name not in self._open:
            file = self.path / name
            if not file.is_file():
                raise ckpt.CheckpointError(f"checkpoint file {file} is missing: the checkpoint is incomplete; "
                                           f"restore it or load another tag")
            self._read_sums()
            assert self._sums is not None
            pieces = self._index.pieces if self._index is not None else None
            piecewise = pieces is not None and name in pieces.rest and name in self._sums
            if piecewise:           # a stat now; the pieces as they are read
                ckpt.verify_size(file, self._sums[name])
            elif name in self._sums:
                self._check_whole(name)
            try:
                self._open[name] = ckpt.torch_load(file, mmap=self.mmap)
                layer = ckpt.layer_module(name, self._open[name])
                if layer is None:
                    layer = ckpt.expert_module(name, self._open[name])
                if layer is not None:       # a pipeline layer's or an expert's file: its tensors under the full names
                    self._open[name]["module"] = layer
                rest = rest_sum(self._index, name, self._open[name], file) if piecewise else None
            except Exception as e:  # noqa: BLE001 - any reader error means the same thing to the user
                self._open.pop(name, None)
                first = str(e).splitlines()[0] if str(e) else ""
                raise ckpt.CheckpointError(f"checkpoint file {file} is truncated or corrupt ({type(e).__name__}: "
                                           f"{first}); restore it or load another tag") from None
            if rest is not None:
                assert self._index is not None and self._index.pieces is not None
                self.bytes_checked += rest[1]
                expected = self._index.pieces.rest[name]
                if rest[0] != expected:
                    self._open.pop(name)
                    raise ckpt.CheckpointError(
                        f"checkpoint file {file} is corrupt: its pickle and the tensors outside its index have "
                        f"CRC-32 {rest[0]:08x} where the save wrote {expected:08x}; restore it or load another tag")
                self._piecewise.add(name)
        return self._open[name]

    def _check_whole(self, name: str) -> None:
        assert self._sums is not None
        if name not in self._whole:
            ckpt.verify_file(self.path / name, self._sums[name])
            self._whole.add(name)
            self.bytes_checked += self._sums[name].size

    def _check_piece(self, file: str, mark: tuple[str, int, str], expected: int | None, piece: torch.Tensor,
                     what: str) -> None:
        if file not in self._piecewise or mark in self._checked:
            return
        if expected is None:            # a piece no rank summed: its file is checked whole instead
            self._check_whole(file)
        else:
            found = ckpt.tensor_crc(piece)
            self.bytes_checked += piece.numel() * piece.element_size()
            if found != expected:
                raise ckpt.CheckpointError(f"checkpoint file {self.path / file} is corrupt: {what} has CRC-32 "
                                           f"{found:08x} where the save wrote {expected:08x}; restore it or load "
                                           f"another tag")
        self._checked.add(mark)

    def check_fragment(self, name: str, j: int, frag: Fragment, key: str, saved: torch.Tensor) -> None:
        """Check fragment `j` of `name` in the saved tensor `saved` ([numel], flat, memory-mapped) of key `key`
        (VALUE, or an optimizer state), once, before its elements are used: the whole fragment, also when a read
        takes part of it (another TP size), so one sum per fragment serves every layout."""
        if self._index is None or self._index.pieces is None:
            return
        file = self._index.entries[frag.entry].file
        sums = self._index.pieces.fragments.get(name, ())
        expected = sums[j].get(key) if j < len(sums) else None
        n = frag.hi - frag.lo
        self._check_piece(file, (name, j, key), expected, saved[frag.dst:frag.dst + n],
                          f"fragment {j} of {name!r} ({key}: elements [{frag.lo}, {frag.hi}) of TP rank "
                          f"{frag.tp_rank}'s slice, at [{frag.dst}, {frag.dst + n}) of the saved tensor)")

    def check_module(self, name: str, tp_rank: int, tensor: torch.Tensor) -> None:
        """Check the module tensor `name` of TP rank `tp_rank` once, before its elements are used."""
        if self._index is None or self._index.pieces is None:
            return
        file = self._index.module[name][tp_rank]
        expected = self._index.pieces.module.get(name, {}).get(tp_rank)
        self._check_piece(file, (name, tp_rank, "module"), expected, tensor,
                          f"module tensor {name!r} (TP rank {tp_rank}'s slice)")


def _mapped_storages(index: CheckpointIndex, name: str, loaded: Any) -> set[int]:
    """The storages (data pointers) of file `name`'s tensors the index maps: module tensors, and the saved
    tensors holding fragments (masters, per-element optimizer states)."""
    mapped: list[torch.Tensor] = [loaded["module"][n] for n, by_rank in index.module.items()
                                  for f in by_rank.values() if f == name]
    for e in index.entries:
        if e.file != name:
            continue
        state = loaded[e.key]
        if e.master_index is not None:
            mapped.append(state["masters"][e.master_index])
        mapped += [v for v in state["optimizer"]["state"].get(e.optimizer_index, {}).values() if per_element(v)]
    return {t.untyped_storage().data_ptr() for t in mapped if t.untyped_storage().nbytes() > 0}


def rest_sum(index: CheckpointIndex | None, name: str, loaded: Any, file: Path) -> tuple[int, int]:
    """(CRC-32, bytes read) of what file `name` holds outside the pieces its index maps: its pickle record (every
    Python value, every tensor's dtype, shape and place in the file) and, in the order they are pickled, the
    tensors whose storage no mapped tensor shares. Left out: DeepSpeed's copy of an optimizer shard beside ours
    (read by DeepSpeed, never by shardwise) and the layer view `FileReader` adds (the same tensors)."""
    assert index is not None
    with zipfile.ZipFile(file) as archive:
        record = next(n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
        pickled = archive.read(record)
    crc, size = zlib.crc32(pickled), len(pickled)
    mapped = _mapped_storages(index, name, loaded)
    skip: set[int] = set()
    if isinstance(loaded, dict):
        if ckpt.NATIVE_OPTIMIZER_STATE_DICT in loaded and ckpt.OPTIMIZER_STATE_DICT in loaded:
            skip.add(id(loaded[ckpt.OPTIMIZER_STATE_DICT]))
        if ckpt.LAYER_FILE.fullmatch(name) or ckpt.EXPERT_FILE.fullmatch(name):
            skip.add(id(loaded.get("module")))
    stack: list[Any] = [loaded]
    while stack:
        item = stack.pop()
        if id(item) in skip:
            continue
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.nbytes() > 0 and storage.data_ptr() not in mapped:
                crc = ckpt.tensor_crc(item, crc)
                size += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return crc, size


def piece_sums(index: CheckpointIndex, folder: Path, names: list[str]) -> PieceSums:
    """The piece sums (`index.PieceSums`) of the files `names` a rank wrote into `folder`, from the files as
    written (their pages are still in the page cache): what `FileReader` checks when it reads them."""
    read = FileReader(folder, sums={})
    build = Assembler(index, read)
    mine = set(names) - {checkpoint_index.INDEX}
    rest = {name: rest_sum(index, name, read(name), folder / name)[0] for name in sorted(mine)}
    fragments: dict[str, tuple[dict[str, int], ...]] = {}
    for n, frags in index.fragments.items():
        out: list[dict[str, int]] = []
        for f in frags:
            entry = index.entries[f.entry]
            if entry.file not in mine:
                out.append({})
                continue
            saved = read(entry.file)[entry.key]["optimizer"]["state"].get(entry.optimizer_index, {})
            keys = [VALUE] + [k for k, v in saved.items() if per_element(v)]
            out.append({k: ckpt.tensor_crc(build.source(f.entry, k, n).reshape(-1)[f.dst:f.dst + f.hi - f.lo])
                        for k in keys})
        fragments[n] = tuple(out)
    module = {n: {t: ckpt.tensor_crc(read(f)["module"][n]) for t, f in by_rank.items() if f in mine}
              for n, by_rank in index.module.items()}
    return PieceSums(fragments=fragments, module={n: m for n, m in module.items() if m}, rest=rest)


class Assembler:
    """Reads TP slices (or runs of them) of saved tensors out of the fragments and module files."""

    def __init__(self, index: CheckpointIndex, read: FileReader, *, check_only: bool = False):
        self.index, self.read = index, read
        self.tp = index.dims.tp
        self.check_only = check_only
        """Only check the pieces a read would use (`FileReader.check_fragment`), copy nothing: what it returns
        is uninitialised."""

    def source(self, entry: int, key: str, name: str) -> torch.Tensor:
        saved = self.index.entries[entry]
        state = self.read(saved.file)[saved.key]
        if key != VALUE:
            return state["optimizer"]["state"][saved.optimizer_index][key]
        if saved.master_index is not None:
            return state["masters"][saved.master_index]
        return self.read(saved.file)["module"][name]    # stage 0 in fp32: the optimizer steps the parameter

    def _saved_run(self, name: str, tp_rank: int, lo: int, hi: int, key: str) -> torch.Tensor:
        """Elements [lo, hi) of TP rank `tp_rank`'s saved slice of `name`, flattened."""
        if key == "module":
            whole = self.read(self.index.module[name][tp_rank])["module"][name]
            self.read.check_module(name, tp_rank, whole)
            run = whole.reshape(-1)[lo:hi]
            return torch.empty(run.shape, dtype=run.dtype) if self.check_only else run
        out: torch.Tensor | None = None
        for j, f in enumerate(self.index.fragments[name]):
            a, b = max(lo, f.lo), min(hi, f.hi)
            if f.tp_rank != tp_rank or a >= b:
                continue
            src = self.source(f.entry, key, name).reshape(-1)
            self.read.check_fragment(name, j, f, key, src)
            if out is None:
                out = torch.empty(hi - lo, dtype=src.dtype)
            if not self.check_only:
                out[a - lo:b - lo] = src[f.dst + a - f.lo:f.dst + b - f.lo]
        assert out is not None, f"{name}: no fragment of TP rank {tp_rank} overlaps [{lo}, {hi})"
        return out

    def holder(self, name: str, key: str, prefer: int) -> int:
        """A saved TP rank holding `name` (`prefer` if it does): any holds a tensor TP does not split whole."""
        held = set(self.index.module.get(name, {})) if key == "module" else \
            {f.tp_rank for f in self.index.fragments.get(name, ())}
        return prefer if prefer in held else min(held)

    def slices(self, name: str, tp_rank: int, tp_size: int, dim: int | None, key: str) -> list[int]:
        """The saved TP ranks whose slices of `name` overlap this rank's (`dim`: this model's split dim)."""
        info = self.index.tensors[name]
        full, saved_dim = info.shape, info.tp_dim
        old = self.tp if saved_dim is not None else 1
        new = tp_size if dim is not None else 1
        if old == new:
            return [tp_rank if old > 1 else self.holder(name, key, tp_rank)]
        split = saved_dim if saved_dim is not None else dim
        assert split is not None        # old != new: the checkpoint or this model splits it
        n_new, n_old = full[split] // new, full[split] // old
        start = (tp_rank if new > 1 else 0) * n_new
        return [j if old > 1 else self.holder(name, key, tp_rank) for j in range(old)
                if max(start, j * n_old) < min(start + n_new, (j + 1) * n_old)]

    def local(self, name: str, tp_rank: int, tp_size: int, dim: int | None, lo: int, hi: int,
              key: str) -> torch.Tensor:
        """Elements [lo, hi) of this rank's TP slice (`tp_rank` of `tp_size`, split along `dim` or whole) of
        `name`, flattened. A tensor saved whole counts as one slice, as does one this model holds whole.

        same TP size, or a tensor TP does not split: the saved slice of the same TP rank has the same flat
            layout, so only the saved fragments overlapping [lo, hi) are copied;
        another TP size: this rank's slice [.., n_new, ..] is filled from every saved slice [.., n_old, ..]
            overlapping it along the split dim (each assembled whole, one at a time), then [lo, hi) is taken.
        """
        info = self.index.tensors[name]
        full, saved_dim = info.shape, info.tp_dim
        old = self.tp if saved_dim is not None else 1
        new = tp_size if dim is not None else 1
        if old == new:
            return self._saved_run(name, self.slices(name, tp_rank, tp_size, dim, key)[0], lo, hi, key)
        split = saved_dim if saved_dim is not None else dim
        assert split is not None        # old != new: the checkpoint or this model splits it
        n_new, n_old = full[split] // new, full[split] // old
        start = (tp_rank if new > 1 else 0) * n_new
        old_shape = [n_old if d == split else n for d, n in enumerate(full)]
        mine: torch.Tensor | None = None
        for j, src in enumerate(self.slices(name, tp_rank, tp_size, dim, key) if old == 1 else range(old)):
            a, b = max(start, j * n_old), min(start + n_new, (j + 1) * n_old)
            if a >= b:
                continue
            saved = self._saved_run(name, src, 0, int(torch.Size(old_shape).numel()), key).view(old_shape)
            if mine is None:
                mine = torch.empty([n_new if d == split else n for d, n in enumerate(full)], dtype=saved.dtype)
            mine.narrow(split, a - start, b - a).copy_(saved.narrow(split, a - j * n_old, b - a))
        assert mine is not None
        return mine.reshape(-1)[lo:hi]


@dataclass(frozen=True)
class LocalTensor:
    """One of this rank's module tensors, as the plan loads it."""

    source: str
    """The full name its fragments are under: its own, or a tied weight's first name."""
    shape: tuple[int, ...] | None
    """Its local shape (this rank's TP slice); None when unknown here (a ZeRO-3 placeholder stepped elsewhere)."""
    tp_dim: int | None
    """The dim this model splits it along under tensor parallelism; None: held whole."""
    dtype: torch.dtype


@dataclass(frozen=True)
class LocalPiece:
    """Elements [lo, hi) of this rank's TP slice of `name`, flattened, at [dst, dst + hi - lo) of a tensor this
    rank steps."""

    name: str
    lo: int
    hi: int
    dst: int


class Plan:
    """What this rank will load, checked against the index (`problem`: the first reason it cannot).

    Every check that needs no change to the run: each of this rank's module tensors exists in the index with the
    same full shape and TP split dim, the pipeline's ranks together hold every tensor of the checkpoint (strict),
    the fragments cover every piece this rank steps, the optimizer has the same options, and every file this rank
    will read opens (memory-mapped: pages are read when a fragment is copied). `agree` then makes its verdict
    every rank's before anything is written.
    """

    def __init__(self, ctx: CheckpointContext, index: CheckpointIndex, read: FileReader, *, strict: bool,
                 optimizer: bool):
        self.ctx, self.index, self.read = ctx, index, read
        self.tp_rank, self.tp_size = ctx.mesh.rank(Axis.TP), ctx.mesh.size(Axis.TP)
        self.optimizer = optimizer
        names = ctx.naming.full_names(ctx.module)
        # Every tensor name of the pipeline's stages and of the dp ranks (which hold different experts of an MoE
        # model), gathered before any check can return (a collective).
        self.pipeline_names = set(names.values())
        for axis in (Axis.DP, Axis.PP):
            gathered = ctx.comm(axis).all_gather_object(sorted(self.pipeline_names))
            self.pipeline_names = {n for keys in gathered for n in keys}
        own = ctx.module.state_dict(keep_vars=True)
        stepped = ctx.state.entries()
        shape_of = {id(p.param): p.shape for e in stepped for p in e.pieces}
        param_name = {id(p): names[n] for n, p in ctx.module.named_parameters()}
        self.module = {names[k]: LocalTensor(param_name.get(id(t), names[k]),
                                             tuple(t.shape) if t.numel() > 0 else shape_of.get(id(t)),
                                             getattr(t, TP_DIM_ATTR, None), t.dtype) for k, t in own.items()}
        # Per tensor this rank steps (the order of `ctx.state.stepped`): the pieces it holds, and its options.
        self.stepped = [[LocalPiece(param_name[id(p.param)], p.lo, p.hi, p.dst) for p in e.pieces] for e in stepped]
        self.options = [e.options for e in stepped]
        self.frozen = {names[k] for k, t in own.items()
                       if isinstance(t, torch.nn.Parameter) and not t.requires_grad}
        self.problem = self._check_module(strict) or (self._check_optimizer() if optimizer else None) \
            or self._open_files()

    def local_shape(self, name: str, dim: int | None) -> tuple[int, ...]:
        """This rank's TP slice shape of `name` (split along `dim`), from the checkpoint's full shape."""
        full = self.index.tensors[name].shape
        return tuple(n // self.tp_size if d == dim else n for d, n in enumerate(full))

    def saved_entry(self, pieces: list[LocalPiece]) -> IndexEntry:
        """The saved tensor holding the first fragment of a stepped tensor's first piece: its options and scalar
        optimizer states (Adam's step) stand for the whole stepped tensor. The first entry when it has none."""
        return self.index.entries[self.index.fragments[pieces[0].name][0].entry if pieces else 0]

    def _check_module(self, strict: bool) -> str | None:
        tensors = self.index.tensors
        written = f"(written at {self.index.dims})"
        if not strict:              # DeepSpeed's load_module_strict=False: this model's extra tensors stay
            self.module = {n: v for n, v in self.module.items() if n in tensors}
        for name, mine in self.module.items():
            if name not in tensors and name in self.frozen:
                return (f"the checkpoint has no value for the frozen parameter {name!r} (saved with "
                        f"exclude_frozen_parameters=True?): load it with load_module_strict=False, which keeps "
                        f"this model's value")
            if name not in tensors:
                return (f"the checkpoint has no tensor {name!r} of this model {written}: it was written for "
                        f"another model; load it into the model that wrote it")
            full, saved_dim, dim = tensors[name].shape, tensors[name].tp_dim, mine.tp_dim
            if saved_dim is not None and dim is not None and saved_dim != dim:
                return (f"{name!r} is split by tensor parallelism along dim {saved_dim} in the checkpoint and "
                        f"along {dim} in this model: it was written for another model or TP plan")
            if dim is not None and full[dim] % self.tp_size:
                return (f"{name!r} has {full[dim]} rows along dim {dim} in the checkpoint, not divisible by "
                        f"tensor_parallel.size = {self.tp_size}: choose a size that divides it")
            if mine.shape is not None:
                want = tuple(n * self.tp_size if d == dim else n for d, n in enumerate(mine.shape))
                if want != tuple(full):
                    return (f"{name!r} has shape {list(full)} in the checkpoint but {list(want)} in this model "
                            f"{written}: it was written for another model")
            if name not in self.index.module and mine.source not in self.index.fragments:
                if name in self.frozen:     # a frozen ZeRO-3 shard is in no file: it keeps the built value
                    continue
                return f"the checkpoint holds no values for {name!r} {written}: save it again with this shardwise"
        if strict:
            extra = sorted(set(tensors) - self.pipeline_names)
            if extra:
                return (f"the checkpoint holds {len(extra)} tensors this model does not have (e.g. {extra[0]!r}): "
                        f"it was written for another model; pass load_module_strict=False to ignore them")
        return None

    def _check_optimizer(self) -> str | None:
        fragments, tensors = self.index.fragments, self.index.tensors
        build = Assembler(self.index, self.read)
        for pieces, options in zip(self.stepped, self.options):
            for piece in pieces:
                name = piece.name
                if name not in fragments:
                    return (f"the checkpoint holds no optimizer state for {name!r} (it was not trained when "
                            f"saved): pass load_optimizer_states=False, or load_module_only=True")
                ranks = build.slices(name, self.tp_rank, self.tp_size, self.module[name].tp_dim, VALUE)
                numel = int(torch.Size(tensors[name].shape).numel())
                numel //= build.tp if tensors[name].tp_dim is not None else 1
                if not all(covered(fragments[name], t, numel) for t in ranks):
                    return f"the checkpoint's optimizer shards do not cover {name!r}: some of its files are missing"
            if pieces:
                saved = self.saved_entry(pieces).options
                if set(saved) - RUN_OWN_OPTIONS != set(options) - RUN_OWN_OPTIONS:
                    return (f"the checkpoint's optimizer has options {sorted(saved)} and this run's "
                            f"{sorted(options)}: it was written with another optimizer; configure the same one")
        return None

    def check_reads(self) -> str | None:
        """Check every piece `apply` will read (its fragments, module tensors and optimizer states, against the
        index's piece sums; copying nothing), before `agree`: a damaged piece refuses the load before anything
        changes. The first problem, or None."""
        build = Assembler(self.index, self.read, check_only=True)
        try:
            for name, mine in self.module.items():
                key = "module" if name in self.index.module else VALUE
                if key == VALUE and mine.source not in self.index.fragments:
                    continue
                local = mine.shape if mine.shape is not None else self.local_shape(name, mine.tp_dim)
                build.local(name if key != VALUE else mine.source, self.tp_rank, self.tp_size, mine.tp_dim, 0,
                            int(torch.Size(local).numel()), key)
            if self.optimizer:
                for pieces in self.stepped:
                    entry = self.saved_entry(pieces)
                    state = self.read(entry.file)[entry.key]["optimizer"]["state"].get(entry.optimizer_index, {})
                    for key in [VALUE] + [k for k, v in state.items() if per_element(v)]:
                        for p in pieces:
                            build.local(p.name, self.tp_rank, self.tp_size, self.module[p.name].tp_dim, p.lo, p.hi,
                                        key)
        except ckpt.CheckpointError as e:
            return str(e)
        return None

    def _needed_files(self) -> list[str]:
        index = self.index
        files = {f for n in self.module for t, f in index.module.get(n, {}).items()}
        names = {v.source for n, v in self.module.items() if n not in index.module}     # from the masters
        if self.optimizer:
            names |= {piece.name for pieces in self.stepped for piece in pieces}
        files |= {index.entries[f.entry].file for n in names for f in index.fragments.get(n, ())}
        return sorted(files | {self.read.head})

    def _open_files(self) -> str | None:
        try:
            for name in self._needed_files():
                self.read(name)
        except ckpt.CheckpointError as e:
            return str(e)
        return None


def agree(ctx: CheckpointContext, problem: str | None, *, same_layout: bool = False) -> bool:
    """Raise the same `CheckpointError` on every rank when any rank found a problem (the lowest rank's line),
    before any rank changes anything; else whether every rank found the checkpoint at its own layout.
    Collective over dp, tp and pp."""
    found = [(ctx.mesh.global_rank, problem, same_layout)]
    for axis in (Axis.DP, Axis.TP, Axis.PP):
        comm = ctx.comm(axis)
        found = [f for part in comm.all_gather_object(found) for f in part]
    problems = [(rank, line) for rank, line, _ in found if line]
    if not problems:
        return all(same for _, _, same in found)
    rank, line = min(problems)
    raise ckpt.CheckpointError(line if len(found) == 1 else f"{line} (found by rank {rank})")


@torch.no_grad()
def apply(plan: Plan, *, load_optimizer_states: bool) -> None:
    """Write the planned tensors into the run (after `agree`): module states a few at a time (at most
    ~`_CHUNK_BYTES` assembled at once), then what the optimizer steps and, with `load_optimizer_states`, its
    state, options and the loss scaler."""
    ctx, build = plan.ctx, Assembler(plan.index, plan.read)
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, mine in plan.module.items():
        key = "module" if name in plan.index.module else VALUE      # ZeRO-3 placeholders: from the masters
        if key == VALUE and mine.source not in plan.index.fragments:
            continue                    # frozen and saved nowhere (checked by the plan)
        local = mine.shape if mine.shape is not None else plan.local_shape(name, mine.tp_dim)
        numel = int(torch.Size(local).numel())
        chunk[name] = build.local(name if key != VALUE else mine.source, plan.tp_rank, plan.tp_size, mine.tp_dim,
                                  0, numel, key).view(local).to(mine.dtype)
        size += numel * chunk[name].element_size()
        if size >= _CHUNK_BYTES:
            ctx.naming.load_module_state(ctx.module, chunk, False)
            chunk, size = {}, 0
    if chunk:
        ctx.naming.load_module_state(ctx.module, chunk, False)
    if not plan.optimizer:
        return
    values: list[torch.Tensor | None] = []
    states, options = [], []
    scaler = None
    for pieces, stepped in zip(plan.stepped, ctx.state.stepped):
        values.append(_stepped(build, plan, pieces, stepped, VALUE))
        entry = plan.saved_entry(pieces)
        saved = plan.read(entry.file)[entry.key]
        scaler = saved["scaler"]
        options.append(dict(entry.options))
        state = saved["optimizer"]["state"].get(entry.optimizer_index, {})
        # Per-element states are assembled like the values; scalars (Adam's step) copied out of the mapped file.
        states.append({k: _stepped(build, plan, pieces, stepped, k) if per_element(v) else
                       (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()})
    ctx.state.load_stepped(values, states if load_optimizer_states else None,
                         options if load_optimizer_states else None, scaler)


def per_element(value: Any) -> bool:
    """Adam's moments, SGD's momentum: one value per element (Adam's `step` is a 0-dim tensor)."""
    return torch.is_tensor(value) and value.dim() > 0


def _stepped(build: Assembler, plan: Plan, pieces: list[LocalPiece], stepped: torch.Tensor,
             key: str) -> torch.Tensor:
    """A tensor shaped like `stepped` (fp32, on the CPU) holding the saved `key` of each piece; padding 0."""
    out = torch.zeros(stepped.numel(), dtype=torch.float32)
    for p in pieces:
        out[p.dst:p.dst + p.hi - p.lo] = build.local(p.name, plan.tp_rank, plan.tp_size, plan.module[p.name].tp_dim,
                                                     p.lo, p.hi, key)
    return out.view(stepped.shape)
