"""What a `shardwise train` checkpoint carries besides the engine's state, and how a rank resumes from it.

The run adds the data position, every rank's random streams and its step and clock to the checkpoint's client
state (`client_state`), so a run continued from it (`resume`) draws the same batches and the same dropout masks
as the run that was not interrupted: its losses are bitwise the same (fp32).
"""

from __future__ import annotations

import copy
import random
import warnings
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


def tag_problem(tag_dir: Path, *, every_byte: bool = False) -> str | None:
    """Why the checkpoint in `tag_dir` cannot be resumed from, as one line naming the file; None when it looks
    whole. Cheap by default, as the parent checks before any rank starts: the directory, its index, and every file
    the index lists, present and of the size the save wrote (the ranks check every byte they read); with
    `every_byte` also each file's CRC-32."""
    from shardwise.checkpoint import files as ckpt
    from shardwise.checkpoint.index import read_index
    from shardwise.errors import CheckpointError

    if not tag_dir.is_dir():
        return f"checkpoint {tag_dir} is missing"
    try:
        index = read_index(tag_dir)
    except CheckpointError as e:
        return str(e)
    expected = dict(index.checksums) if index is not None else {}
    for name in expected or [ckpt.head_name(tag_dir) or ckpt.MODEL_STATES]:
        file = tag_dir / name
        if not file.is_file():
            return f"checkpoint file {file} is missing"
        sums = expected.get(name)
        if sums is not None and file.stat().st_size != sums.size:
            return (f"checkpoint file {file} is truncated or corrupt: {file.stat().st_size} bytes where the save "
                    f"wrote {sums.size}")
        if sums is not None and every_byte:
            try:
                ckpt.verify_file(file, sums)
            except CheckpointError as e:
                return str(e)
    return None


def _refused(checkpoints: Path, problem: str, step: int | None) -> Exception:
    """The one line a rank raises for a checkpoint it cannot resume from, offering the previous complete tag."""
    from shardwise.cli.run_dir import previous_complete
    from shardwise.errors import CheckpointError

    # On this failure path every byte of the tag offered is checked: the offer is one that loads.
    previous = previous_complete(checkpoints.parent, step, lambda tag: tag_problem(tag, every_byte=True))
    offer = (f"; resume from the previous complete checkpoint with --resume-from {previous}" if previous is not None
             else "; no earlier complete checkpoint is there: --overwrite starts the run over")
    return CheckpointError(f"{problem}{offer}")


def resume(engine: Any, loader: TokenLoader, checkpoints: Path) -> Resumed | None:
    """Load checkpoints/latest into the engine, the loader and the random streams; None when there is none.
    Collective: every rank calls it (the engine's load agrees across ranks). The random streams are restored when
    the saved data-parallel size is this run's; after a layout change dropout draws fresh masks (the caller says
    so once, from `rng_restored`). The learning-rate schedule is this launch's config's, at the checkpoint's
    position (`follow_config_schedule`): an extended run's recomputed warm-up applies from the resumed step."""
    from shardwise.checkpoint import files as ckpt
    from shardwise.cli.run_dir import previous_complete, tag_step
    from shardwise.errors import CheckpointError

    latest = checkpoints / ckpt.LATEST
    if not latest.is_file():
        # Never start over beside checkpoints: an attempt that finds tags but no `latest` stops.
        if previous_complete(checkpoints.parent, None, None) is not None:
            raise _refused(checkpoints, f"{checkpoints} holds checkpoints but no {latest.name}", None)
        return None
    tag = ckpt.read_latest(latest)
    fresh = schedule_start(engine.lr_scheduler)
    try:
        path, client = engine.load_checkpoint(str(checkpoints))
    except CheckpointError as e:
        # A damaged tag: offer the previous whole one. Another refusal (a layout an index-less checkpoint cannot
        # load at, say) is the same for every tag of the run: said as it is.
        if tag_problem(checkpoints / tag, every_byte=True) is None:
            raise
        raise _refused(checkpoints, str(e), tag_step(tag)) from None
    if path is None:           # `latest` names a tag that is not there: never train from step 0 instead
        raise _refused(checkpoints, f"checkpoint {checkpoints / tag} named by {latest} is missing", tag_step(tag))
    client = client or {}
    if "data" not in client:
        from shardwise.errors import CheckpointError
        raise CheckpointError(f"{path} was not written by `shardwise train` (its client state has no data "
                              f"position): resume it with the script that wrote it, or choose another --out")
    loader.load_state_dict(client["data"])
    follow_config_schedule(engine.lr_scheduler, fresh)
    streams = client.get("rng") or []
    restored = len(streams) == engine.dp_size
    if restored:
        set_rng_state(engine, streams[engine.dp_rank])
    return Resumed(path=path, step=int(client.get("step", engine.global_steps)),
                   elapsed_s=float(client.get("elapsed_s", 0.0)), rng_restored=restored)


# -- the learning-rate schedule of a resumed run ------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleStart:
    """A scheduler as the config built it (before any step), and its optimizer's learning rates then."""

    state: dict[str, Any]
    group_lrs: list[float]


def schedule_start(scheduler: Any) -> ScheduleStart | None:
    """Snapshot a scheduler as built, before a checkpoint's state replaces it (None without a scheduler)."""
    if scheduler is None:
        return None
    return ScheduleStart(copy.deepcopy(scheduler.state_dict()),
                         [float(g["lr"]) for g in scheduler.optimizer.param_groups])


def follow_config_schedule(scheduler: Any, start: ScheduleStart | None) -> None:
    """Put `scheduler` (just loaded from a checkpoint, which carries the schedule's parameters as the earlier
    launch built them) back on this launch's schedule at the same position: its state as built, stepped as many
    times as the checkpoint's. Steps the checkpoint skipped (inf/nan gradients) did not step the schedule
    either, so the position is the scheduler's own count, not the global step. The same config gives the same
    learning rates bit for bit (each schedule is a function of the step count)."""
    if scheduler is None or start is None:
        return
    position = int(scheduler.last_epoch)
    scheduler.load_state_dict(copy.deepcopy(start.state))
    for group, lr in zip(scheduler.optimizer.param_groups, start.group_lrs):
        group["lr"] = lr
    with warnings.catch_warnings():
        # torch warns when a schedule steps before its optimizer has: here it only replays the count.
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(position - int(scheduler.last_epoch)):
            scheduler.step()


def _lr_after(config: dict[str, Any], steps: int) -> float | None:
    """The learning rate of the first param group after `steps` scheduler steps of `config`'s schedule: the lr
    step `steps + 1` trains at. None when the config names no optimizer, or one built only on a device."""
    from shardwise.config import ConfigError
    from shardwise.config.schema import OptimizerSpec, SchedulerSpec
    from shardwise.engine.optim import build_optimizer, build_scheduler

    if not isinstance(config.get("optimizer"), dict):
        return None
    try:
        optimizer = build_optimizer(OptimizerSpec(**config["optimizer"]), [torch.nn.Parameter(torch.zeros(1))])
        if not isinstance(config.get("scheduler"), dict):
            return float(optimizer.param_groups[0]["lr"])
        scheduler = build_scheduler(SchedulerSpec(**config["scheduler"]), optimizer)
    except (ConfigError, ValueError, TypeError, RuntimeError):
        return None
    start = schedule_start(scheduler)
    scheduler.last_epoch = steps           # replayed from the start as a resumed rank does
    follow_config_schedule(scheduler, start)
    return float(optimizer.param_groups[0]["lr"])


def schedule_note(before: dict[str, Any], now: dict[str, Any], steps_before: int, steps_now: int, at: int) -> str:
    """One line for a run resumed at step `at` with --steps changed: the schedule's length there and now, and the
    lr step `at + 1` trains at under each."""
    def length(config: dict[str, Any]) -> dict[str, Any]:
        scheduler = config.get("scheduler")
        params = scheduler.get("params", {}) if isinstance(scheduler, dict) else {}
        return {key.removesuffix("_num_steps"): params[key] for key in ("warmup_num_steps", "total_num_steps")
                if key in params}

    there, here = length(before), length(now)
    lengths = ", ".join(f"{name} {there.get(name, 'unset')} -> {here.get(name, 'unset')}"
                        if there.get(name) != here.get(name) else f"{name} {here[name]}" for name in {**there, **here})
    old, new = _lr_after(before, at), _lr_after(now, at)
    if old is None or new is None:
        lrs = f"step {at + 1} trains at the new schedule's lr"
    elif old == new:
        lrs = f"step {at + 1} trains at lr {new:.4g}, as it would have"
    else:
        lrs = f"step {at + 1} trains at lr {new:.4g} where the old schedule gave {old:.4g}"
    if there == here:
        same = f" ({lengths} steps)" if lengths else ""
        return f"--steps {steps_before} -> {steps_now}: the schedule's length is unchanged{same}; {lrs}"
    return f"--steps {steps_before} -> {steps_now}: the schedule is recomputed ({lengths} steps); {lrs}"
