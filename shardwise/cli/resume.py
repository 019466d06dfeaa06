"""What a `shardwise train` checkpoint carries besides the engine's state, and how a rank resumes from it.

The run adds the data position, every rank's random streams and its step and clock to the checkpoint's client
state (`client_state`), so a run continued from it (`resume`) draws the same batches and the same dropout masks
as the run that was not interrupted: its losses are bitwise the same (fp32).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardwise.data import TokenLoader

CLIENT_FORMAT = 1


def _tp_streams(module: torch.nn.Module) -> list[Any]:
    """The tensor-parallel dropout streams of this rank's modules (shared objects counted once), in module order."""
    from shardwise.parallel.tensor_parallel.random import TP_RNG_ATTR

    seen: dict[int, Any] = {}
    for sub in module.modules():
        rng = getattr(sub, TP_RNG_ATTR, None)
        if rng is not None:
            seen.setdefault(id(rng), rng)
    return list(seen.values())


def rng_state(engine: Any) -> dict[str, Any]:
    """This rank's random streams, as plain CPU tensors and tuples."""
    device = engine.device
    return {"torch": torch.get_rng_state(),
            "device": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "tp_streams": [rng.local_state.cpu() for rng in _tp_streams(engine.module)],
            "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(engine: Any, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("device") is not None and engine.device.type == "cuda":
        torch.cuda.set_rng_state(state["device"], engine.device)
    streams = _tp_streams(engine.module)
    if len(streams) == len(state["tp_streams"]):
        for rng, saved in zip(streams, state["tp_streams"]):
            rng.local_state = saved
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def client_state(engine: Any, loader: TokenLoader, *, step: int, elapsed_s: float) -> dict[str, Any]:
    """The client state of a checkpoint at `step`. Collective over the data-parallel group (gathers the streams).

    The engine's checkpoint restores the model, the optimizer (with the loss scaler), the scheduler and the step
    counters; this adds (written by data-parallel rank 0 of each model-parallel position, into that position's
    file):
    - "data": the TokenLoader's position (its next step and micro-step, and the seed it belongs to);
    - "rng": every data-parallel rank's random streams, indexed by dp rank: the default generator of the CPU and
      of the compute device, each tensor-parallel dropout stream, numpy's and Python's;
    - "step" and "elapsed_s": where the run was, so the metrics continue with the step and the clock.
    """
    mine = rng_state(engine)
    streams: list[Any] = [mine]
    if engine.dp_size > 1:
        streams = [None] * engine.dp_size
        dist.all_gather_object(streams, mine, group=engine.dp_comm.group)
    return {"format": CLIENT_FORMAT, "step": step, "elapsed_s": elapsed_s, "data": loader.state_dict(),
            "rng": streams}


@dataclass(frozen=True)
class Resumed:
    """Where a rank resumed: the checkpoint's path, its step and the run's clock then."""

    path: str
    step: int
    elapsed_s: float
    rng_restored: bool


def resume(engine: Any, loader: TokenLoader, checkpoints: Path) -> Resumed | None:
    """Load checkpoints/latest into the engine, the loader and the random streams; None when there is none.
    Collective: every rank calls it (the engine's load agrees across ranks). The random streams are restored when
    the saved data-parallel size is this run's; after a layout change dropout draws fresh masks (the caller says
    so once, from `rng_restored`)."""
    if not (checkpoints / "latest").is_file():
        return None
    path, client = engine.load_checkpoint(str(checkpoints))
    if path is None:
        return None
    client = client or {}
    if "data" not in client:
        from shardwise.errors import CheckpointError
        raise CheckpointError(f"{path} was not written by `shardwise train` (its client state has no data "
                              f"position): resume it with the script that wrote it, or choose another --out")
    loader.load_state_dict(client["data"])
    streams = client.get("rng") or []
    restored = len(streams) == engine.dp_size
    if restored:
        set_rng_state(engine, streams[engine.dp_rank])
    return Resumed(path=path, step=int(client.get("step", engine.global_steps)),
                   elapsed_s=float(client.get("elapsed_s", 0.0)), rng_restored=restored)
