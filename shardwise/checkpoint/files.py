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
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import types
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

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


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save into a temporary file of the same directory, then renamed over `path`: never half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    os.close(fd)
    try:
        _save(obj, Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_tag(save_dir: str | os.PathLike[str], tag: str, files: dict[str, Any], *, rank: int = 0,
              barrier: Callable[[], None] = lambda: None,
              any_failed: Callable[[bool], bool] = lambda failed: failed, save_latest: bool = True,
              then: Callable[[Path], dict[str, Any]] | None = None) -> Path:
    """Collective save: every rank writes its `files` ({name: object}) into SAVE_DIR/.TAG.staging; then rank 0
    moves the directory into place as SAVE_DIR/TAG (replacing an older one) and, with `save_latest`, points
    `latest` at it (without it `latest` keeps naming the tag it named: DeepSpeed's save_latest=False).
    Every rank must call it with the same tag. `barrier` synchronises the ranks and `any_failed(flag)` tells
    every rank whether any rank failed to write (both trivial for one process): then nothing is published
    and the previous checkpoint and `latest` stay as they were. `then(staging)`, once every rank has written its
    files, gives files to write over them (built from what every rank staged); written atomically, agreed too."""
    if not tag or "/" in tag or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a non-empty name without '/' or a leading '.'")
    root = Path(save_dir)
    staging = root / f".{tag}.staging"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)   # left by a crashed save
        staging.mkdir()
    barrier()
    error: BaseException | None = None
    try:
        for name, obj in files.items():
            _save(obj, staging / name)
    except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks know
        error = e
    failed = any_failed(error is not None)
    if not failed and then is not None:
        try:        # every rank has staged its files: a second pass may read them all
            for name, obj in then(staging).items():
                atomic_save(obj, staging / name)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks know
            error = e
        failed = any_failed(error is not None)
    if failed:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if error is not None:
            raise error
        raise CheckpointError(f"saving checkpoint {tag!r} failed on another rank; nothing was published")
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
        tag = latest.read_text().strip()
    path = root / tag
    if not path.is_dir():
        warnings.warn(f"no checkpoint loaded: no tag {tag!r} in {root} (tags present: {_tags(root) or 'none'})",
                      CheckpointWarning, stacklevel=4)
        return None
    if head_name(path) is None:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {MODEL_STATES} (or {ZERO3_MODEL_STATES}); "
                              f"restore it or load another tag (tags present: {_tags(root)})")
    return path


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
    states: dict[str, Any] = torch_load(file)
    return states


def read_optim_states(path: Path, dp_rank: int, mp_rank: int = 0) -> dict[str, Any]:
    file = path / optim_states_name(dp_rank, mp_rank)
    if not file.is_file():
        raise CheckpointError(f"{path} has no optimizer shard for data-parallel rank {dp_rank} ({file.name}): it was "
                              f"written with fewer ranks or without ZeRO; load it with the layout that wrote it")
    states: dict[str, Any] = torch_load(file)
    return states
