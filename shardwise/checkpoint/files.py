"""Checkpoints in DeepSpeed's layout, written atomically.

    SAVE_DIR/latest                              text: the newest tag (`latest_universal` for DeepSpeed's
                                                 universal checkpoints)
    SAVE_DIR/TAG/mp_rank_MM_model_states.pt      module, optimizer, scheduler, counters, config, client state
    SAVE_DIR/TAG/zero_pp_rank_R_mp_rank_MM_model_states.pt   ZeRO-3 instead: one per data-parallel rank
    SAVE_DIR/TAG/[bf16_]zero_pp_rank_R_mp_rank_MM_optim_states.pt   ZeRO: data-parallel rank R's optimizer shard
    SAVE_DIR/TAG/layer_XX-model_states.pt        a pipeline of layers: layer XX's module states

MM is the model-parallel rank, pp_stage * tp + tp_rank as in DeepSpeed's grid (00 without model parallelism):
each (stage, TP rank)'s files hold its slices, written by the ranks of data-parallel index 0 (model states) and
by every rank (ZeRO optimizer shards).

A tag directory is first written as SAVE_DIR/.TAG.staging (by every rank) and renamed into place, and `latest` is
replaced with os.replace, so a crash mid-save leaves the previous checkpoint and `latest` intact.

Every file's size and CRC-32 are taken as it is written (`FileSum`) and kept in the tag's index, so a loader
checks each file it reads whole (`verify_file`; one reading pieces through the memory map checks those instead,
`tensor_crc` against the index's `PieceSums`) and a flipped byte or a cut file is one line naming it. CRC-32 is
zlib's (~2 GB/s on one core: ~50 ms for 100 MB, beside the write itself); it catches storage damage, not
tampering.
"""

from __future__ import annotations

import errno
import importlib
import os
import pickle
import re
import types
import shutil
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import IO, Any, Callable, Mapping, NamedTuple, cast

import torch

from shardwise.errors import CheckpointError, UserError

def model_states_name(mp_rank: int = 0) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero3_model_states_name(dp_rank: int, mp_rank: int = 0) -> str:
    """DeepSpeed's ZeRO-3 model states: one file per dp rank (its parameters are placeholders there)."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


MODEL_STATES = model_states_name(0)
ZERO3_MODEL_STATES = zero3_model_states_name(0)
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
NATIVE_OPTIMIZER_STATE_DICT = "shardwise_optimizer_state_dict"
"""Where a ZeRO optimizer file keeps our own shard, beside DeepSpeed's `optimizer_state_dict` (a file written
by an earlier shardwise has only ours, under DeepSpeed's key)."""


def native_optimizer_state(saved: dict[str, Any]) -> Any:
    """Our own shard of a ZeRO optimizer file."""
    return saved.get(NATIVE_OPTIMIZER_STATE_DICT, saved.get(OPTIMIZER_STATE_DICT))


def head_name(path: Path) -> str | None:
    """The model-states file holding a tag's counters, config and client state: `mp_rank_00_model_states.pt`,
    or DeepSpeed's ZeRO-3 name for dp rank 0 (a ZeRO-3 tag has no other). None when the tag has neither."""
    for name in (MODEL_STATES, ZERO3_MODEL_STATES):
        if (path / name).is_file():
            return name
    return None


LAYER_FILE = re.compile(r"layer_(\d+)-model_states\.pt")
"""A pipeline layer's own state dict, as DeepSpeed's PipelineModule saves each layer (without tensor
parallelism): layer i's tensors under the layer's own names."""
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
"""Our PipelineModule's (and every layer-list pipeline's) name of a tensor of layer i: "layers.i.<name>"."""


def layer_file_name(layer: int) -> str:
    return f"layer_{layer:02d}-model_states.pt"


def layer_file_of(full_name: str) -> tuple[str, str] | None:
    """(layer file, name in it) of a layer-list pipeline's tensor ("layers.3.ln.weight" -> layer_03, "ln.weight");
    None for another name."""
    m = _LAYER_NAME.fullmatch(full_name)
    return None if m is None else (layer_file_name(int(m.group(1))), m.group(2))


def layer_module(file: str, saved: dict[str, Any]) -> dict[str, Any] | None:
    """A layer file's tensors under our pipeline's full names; None when `file` is no layer file."""
    m = LAYER_FILE.fullmatch(file)
    if m is None:
        return None
    return {f"layers.{int(m.group(1))}.{k}": v for k, v in saved.items() if hasattr(v, "shape")}


EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt")
"""One expert's module states, as DeepSpeed saves its MoE layers' experts: a plain dict of the expert's tensors
under the whole model's names (its global expert index)."""


def expert_file_name(layer: int, expert: int, mp_rank: int = 0) -> str:
    """DeepSpeed's file of global expert `expert` of MoE layer `layer` (the layers counted in module order)."""
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def expert_optim_states_name(ep_rank: int, mp_rank: int = 0) -> str:
    """DeepSpeed's optimizer file of expert-parallel rank `ep_rank` without ZeRO (written by the first rank of
    each expert-data-parallel group)."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def expert_module(file: str, saved: dict[str, Any]) -> dict[str, Any] | None:
    """An expert file's tensors under the full names (the file's own keys); None when `file` is no expert file."""
    if EXPERT_FILE.fullmatch(file) is None:
        return None
    return {k: v for k, v in saved.items() if hasattr(v, "shape")}


def atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def optim_states_name(dp_rank: int, mp_rank: int = 0, *, bf16: bool = False) -> str:
    """A ZeRO rank's optimizer file; DeepSpeed prefixes it "bf16_" when it trains in bf16 (and looks for that
    name then)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


class FileSum(NamedTuple):
    """A checkpoint file's size in bytes and the CRC-32 of its bytes."""

    size: int
    crc32: int


class _Summing:
    """A binary file that sums what is written through it (torch.save writes sequentially, never seeking)."""

    def __init__(self, f: IO[bytes]):
        self.f, self.size, self.crc = f, 0, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


_CHUNK = 8 << 20


def file_sum(path: Path) -> FileSum:
    """The size and CRC-32 of a file as it is on disk, read in 8 MiB pieces."""
    crc = size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileSum(size, crc)


def tensor_crc(tensor: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a CPU tensor's elements in flat order, as bytes (continuing `crc`). On a memory-mapped tensor it
    reads exactly its pages."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return crc
    return zlib.crc32(flat.contiguous().view(torch.uint8).numpy().data, crc)


def verify_size(path: Path, expected: FileSum) -> None:
    """CheckpointError, one line naming `path`, when its size is not the size the save wrote (a stat, no read)."""
    size = path.stat().st_size
    if size != expected.size:
        raise CheckpointError(f"checkpoint file {path} is truncated or corrupt: {size} bytes where the save "
                              f"wrote {expected.size}; restore it or load another tag")


def verify_file(path: Path, expected: FileSum) -> None:
    """CheckpointError, one line naming `path`, when it is not the file the save wrote."""
    verify_size(path, expected)
    found = file_sum(path)
    if found.size != expected.size:
        raise CheckpointError(f"checkpoint file {path} is truncated or corrupt: {found.size} bytes where the save "
                              f"wrote {expected.size}; restore it or load another tag")
    if found.crc32 != expected.crc32:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its CRC-32 is {found.crc32:08x} where the save "
                              f"wrote {expected.crc32:08x}; restore it or load another tag")


def _payload_bytes(obj: Any) -> int:
    """The bytes of the tensors in a checkpoint object, each storage once: about the size of its file."""
    seen: dict[tuple[int, int], int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(seen.values())


def _disk_full(error: BaseException, path: Path, obj: Any) -> CheckpointError | None:
    """The one line for a write that ran out of space (torch reports it as "enforce fail ... unexpected pos"),
    naming the file, the bytes it needs and the bytes free; None when the disk is not full."""
    needed = _payload_bytes(obj)
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return None
    out_of_space = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
    if not out_of_space and free >= needed:
        return None
    return CheckpointError(f"no space left to save {path}: it needs about {needed:,} bytes and the disk holds "
                           f"{free:,} free; free some space (or save elsewhere), then resume from the last "
                           f"checkpoint")


def _save(obj: Any, path: Path) -> FileSum:
    """torch.save `obj` to `path` and fsync it; its size and CRC-32. A full disk is one `CheckpointError`."""
    try:
        with open(path, "wb") as f:
            out = _Summing(f)
            torch.save(obj, cast(IO[bytes], out))
            f.flush()
            os.fsync(f.fileno())
    except Exception as e:  # noqa: BLE001 - only a full disk is translated; the rest is re-raised as it is
        full = _disk_full(e, path, obj)
        path.unlink(missing_ok=True)
        if full is not None:
            raise full from None
        raise
    return FileSum(out.size, out.crc)


def atomic_save(obj: Any, path: Path) -> FileSum:
    """torch.save into a temporary file of the same directory, then renamed over `path`: never half a file. Its
    size and CRC-32."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    os.close(fd)
    try:
        written = _save(obj, Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return written


def staging_dir(save_dir: str | os.PathLike[str], tag: str) -> Path:
    """Where `write_tag` stages a tag's files before it moves them into place."""
    return Path(save_dir) / f".{tag}.staging"


def write_tag(save_dir: str | os.PathLike[str], tag: str, files: dict[str, Any], *, rank: int = 0,
              barrier: Callable[[], None] = lambda: None,
              any_failed: Callable[[bool], bool] = lambda failed: failed, save_latest: bool = True,
              then: Callable[[Path], dict[str, Any]] | None = None,
              seal: Callable[[dict[str, FileSum]], dict[str, Any]] | None = None) -> Path:
    """Collective save: every rank writes its `files` ({name: object}) into SAVE_DIR/.TAG.staging; then rank 0
    moves the directory into place as SAVE_DIR/TAG (replacing an older one) and, with `save_latest`, points
    `latest` at it (without it `latest` keeps naming the tag it named: DeepSpeed's save_latest=False).
    Every rank must call it with the same tag. `barrier` synchronises the ranks and `any_failed(flag)` tells
    every rank whether any rank failed to write (both trivial for one process): then nothing is published
    and the previous checkpoint and `latest` stay as they were. `then(staging)`, once every rank has written its
    files, gives files to write over them (built from what every rank staged); written atomically, agreed too.

    `seal(sums)`, collective when given: every rank passes the sums of the files it wrote (a file `then` rewrote:
    its second version); it returns the files that record them (world rank 0: the index with every rank's sums;
    {} elsewhere), written last."""
    if not tag or "/" in tag or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a non-empty name without '/' or a leading '.'")
    root = Path(save_dir)
    staging = staging_dir(root, tag)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)   # left by a crashed save
        staging.mkdir()
    barrier()
    error: BaseException | None = None
    sums: dict[str, FileSum] = {}
    try:
        for name, obj in files.items():
            sums[name] = _save(obj, staging / name)
    except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks know
        error = e
    # Every rank takes the same branches: each `failed` is agreed by `any_failed`; None: not asked since the
    # last write.
    failed: bool | None = None
    if then is not None:
        failed = any_failed(error is not None)
        if not failed:
            try:        # every rank has staged its files: a second pass may read them all
                for name, obj in then(staging).items():
                    sums[name] = atomic_save(obj, staging / name)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks know
                error = e
            failed = None
    if not failed and seal is not None:
        sealed = seal(sums)       # collective: every rank calls it, also after a failed second pass
        try:
            for name, obj in sealed.items():
                if error is None:
                    _save(obj, staging / name)
        except BaseException as e:  # noqa: BLE001 - as above
            error = e
        failed = None
    if failed is None:
        failed = any_failed(error is not None)
    if failed:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if error is not None:
            raise error
        raise SaveFailedElsewhere(f"saving checkpoint {tag!r} failed on another rank (which reports why); "
                                  f"nothing was published")
    final = root / tag
    if rank == 0:
        # Every rank has written its files: no save is still writing into another staging directory.
        remove_stale_staging(root, keep=staging)
        try:
            if final.exists():
                # Replace an existing tag: move it aside first so there is never a moment without one.
                old = Path(tempfile.mkdtemp(dir=root, prefix=f".{tag}.old-"))
                os.replace(final, old / tag)
                os.replace(staging, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if save_latest:
            atomic_write_text(root / LATEST, tag)
    barrier()
    return final


class SaveFailedElsewhere(CheckpointError):
    """This rank wrote its part of a checkpoint, another rank failed to. A consequence: the failing rank raises
    the cause (a full disk's line, say), which `shardwise train` reports instead of this."""


class CheckpointWarning(UserWarning):
    """Nothing to load where a checkpoint was asked for (DeepSpeed logs a warning and loads nothing)."""


def _tags(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if root.is_dir() else []


_OURS = re.compile(r"\.?((zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt|layer_\d+-model_states\.pt|"
                   r"(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt|"
                   r"shardwise_index\.pt)(\.tmp-.*)?")          # ".NAME.tmp-*": a half-written atomic_save


def remove_stale_staging(root: Path, *, keep: Path) -> list[Path]:
    """Remove the `.TAG.staging` directories a killed save left in `root` (other than `keep`), only those
    holding nothing but our checkpoint files. Returns what was removed."""
    removed = []
    for d in root.glob(".*.staging"):
        if d == keep or not d.is_dir() or d.is_symlink():
            continue
        if all(f.is_file() and _OURS.fullmatch(f.name) for f in d.iterdir()):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def resolve_tag(load_dir: str | os.PathLike[str], tag: str | None) -> Path | None:
    """The directory of `tag`, or of the tag named in `latest` when tag is None. None, with one warning line,
    when there is none (a missing directory, no `latest`, no such tag): DeepSpeed's load_checkpoint then
    returns (None, None) too. A tag directory without its model states is damaged: `CheckpointError`."""
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file() and (root / LATEST_UNIVERSAL).is_file():
            latest = root / LATEST_UNIVERSAL            # only a universal checkpoint (ds_to_universal.py)
        if not latest.is_file():
            warnings.warn(f"no checkpoint loaded: unable to find latest file at {latest} (tags present: "
                          f"{_tags(root) or 'none'}); pass an explicit tag to load another", CheckpointWarning,
                          stacklevel=4)
            return None
        tag = read_latest(latest)
    path = root / tag
    if not path.is_dir():
        warnings.warn(f"no checkpoint loaded: no tag {tag!r} in {root} (tags present: {_tags(root) or 'none'})",
                      CheckpointWarning, stacklevel=4)
        return None
    if head_name(path) is None:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {MODEL_STATES} (or {ZERO3_MODEL_STATES}); "
                              f"restore it or load another tag (tags present: {_tags(root)})")
    return path


def read_latest(latest: Path) -> str:
    """The tag a `latest` file names; one CheckpointError line naming it when it holds no tag name (binary
    bytes, several lines, a path)."""
    try:
        tag = latest.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{latest} is not text (it should hold a tag name such as global_step100): "
                              f"write the tag to load into it, or pass the tag explicitly") from None
    if not tag or "/" in tag or "\n" in tag or tag.startswith("."):
        raise CheckpointError(f"{latest} holds {tag[:60]!r}, not a tag name such as global_step100: write the "
                              f"tag to load into it, or pass the tag explicitly")
    return tag


class _Unpickler(pickle.Unpickler):
    """Resolves the DeepSpeed class references our ZeRO-3 files hold (`deepspeed_write._Reference`) to a plain
    record where DeepSpeed is not installed; everything else as pickle does."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("importlib", "import_module"):
            return _import_or_record
        return super().find_class(module, name)


class _Absent:
    """A module that is not installed: its classes build records of their arguments (and, once unpickled, of
    their attributes)."""

    def __init__(self, module: str):
        self.module = module

    def __getattr__(self, name: str) -> Callable[..., types.SimpleNamespace]:
        return lambda *args: types.SimpleNamespace(cls=f"{self.module}.{name}", args=args)


def _import_or_record(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        return _Absent(module)


_PICKLE = types.ModuleType("shardwise_checkpoint_pickle")
_PICKLE.Unpickler = _Unpickler      # type: ignore[attr-defined]
_PICKLE.load = pickle.load          # type: ignore[attr-defined]
_PICKLE.__dict__.update({"Pickler": pickle.Pickler, "dump": pickle.dump, "loads": pickle.loads})


def torch_load(file: Path, *, mmap: bool = False) -> Any:
    """torch.load of a checkpoint file (ours or DeepSpeed's) onto the CPU."""
    return torch.load(file, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=_PICKLE)


def model_states_file(path: Path, mp_rank: int = 0) -> Path:
    """The model states of model-parallel rank `mp_rank`: `mp_rank_MM_model_states.pt`, or at ZeRO-3 (DeepSpeed's
    names) dp rank 0's `zero_pp_rank_0_mp_rank_MM_model_states.pt`."""
    plain = path / model_states_name(mp_rank)
    zero3 = path / zero3_model_states_name(0, mp_rank)
    return zero3 if not plain.is_file() and zero3.is_file() else plain


def read_model_states(path: Path, mp_rank: int = 0) -> dict[str, Any]:
    file = model_states_file(path, mp_rank)
    if not file.is_file():
        raise CheckpointError(f"{path} has no model states for tensor-parallel rank {mp_rank} ({file.name}): it was "
                              f"written with a smaller tensor_parallel.size; load it with the size that wrote it")
    _check_sum(path, file)
    states: dict[str, Any] = torch_load(file)
    return states


def read_optim_states(path: Path, dp_rank: int, mp_rank: int = 0) -> dict[str, Any]:
    file = path / optim_states_name(dp_rank, mp_rank)
    if not file.is_file():
        raise CheckpointError(f"{path} has no optimizer shard for data-parallel rank {dp_rank} ({file.name}): it was "
                              f"written with fewer ranks or without ZeRO; load it with the layout that wrote it")
    _check_sum(path, file)
    states: dict[str, Any] = torch_load(file)
    return states


def _check_sum(tag_dir: Path, file: Path) -> None:
    """Verify `file` against the CRC-32 the tag's index recorded (nothing to check without one: said once)."""
    from shardwise.checkpoint.index import read_checksums    # index.py builds on this module

    sums = read_checksums(tag_dir)
    if sums is not None and file.name in sums:
        verify_file(file, sums[file.name])
