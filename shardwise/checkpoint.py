"""Checkpoints in DeepSpeed's layout, written atomically.

    SAVE_DIR/latest                              text: the newest tag
    SAVE_DIR/TAG/mp_rank_00_model_states.pt      module, optimizer, scheduler, counters, config, client state

A tag directory is first written as SAVE_DIR/.TAG.tmp-XXXX and renamed into place, and `latest` is
replaced with os.replace, so a crash mid-save leaves the previous checkpoint and `latest` intact.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from shardwise.errors import UserError

MODEL_STATES = "mp_rank_00_model_states.pt"
LATEST = "latest"


class CheckpointError(UserError):
    pass


def atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_tag(save_dir: str | os.PathLike, tag: str, files: dict[str, Any]) -> Path:
    """Write {filename: object} with torch.save into SAVE_DIR/TAG atomically, then point `latest` at it."""
    if not tag or "/" in tag or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a non-empty name without '/' or a leading '.'")
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{tag}.tmp-"))
    try:
        for name, obj in files.items():
            with open(staging / name, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
        final = root / tag
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
    atomic_write_text(root / LATEST, tag)
    return final


def resolve_tag(load_dir: str | os.PathLike, tag: str | None) -> Path | None:
    """The directory of `tag`, or of the tag named in `latest` when tag is None (None if there is none)."""
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
    path = root / tag
    if not (path / MODEL_STATES).is_file():
        raise CheckpointError(f"no checkpoint at {path}: missing {MODEL_STATES} "
                              f"(tags present: {sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith('.')) if root.is_dir() else 'none'})")
    return path


def read_model_states(path: Path) -> dict:
    return torch.load(path / MODEL_STATES, map_location="cpu", weights_only=False)
