"""What `shardwise train` does with a run directory that already holds a run: start, resume or refuse (`decide`).

A run directory is one run's history: `metrics.jsonl` (appended; rows after a resumed step are set aside in
`metrics.dropped.jsonl`), `checkpoints/` (tags only added, `latest` only moved forward, or back to the tag
`--resume-from` names) and `train_args*.json` (what the run is). No torch here: the parent decides before any rank
starts. The ranks then load `latest` whenever it exists, so an elastic restart resumes the same way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from shardwise.errors import UserError

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
LOGS_DIR = "logs"
LATEST = "latest"
IDENTITY = ("model", "seq_len", "vocab_size", "data", "seed")
"""The WorkerArgs fields that make two runs the same run, with the config's keys that change what is computed
(`what_matters`). `steps` may change: extending a run is resuming it."""
LAYOUT_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "tensor_parallel", "autotp_size", "pipeline", "context_parallel", "sequence_parallel_size", "expert_parallel",
    "activation_checkpointing", "communication",
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "tensorboard", "csv_monitor", "wandb",
    "comms_logger", "flops_profiler", "dataloader_drop_last"})
"""Config keys that say how a run is laid out over its ranks (and what it prints), not what it computes: a
checkpoint reshards across them exactly, so a run may resume with them changed. So does `zero_optimization`,
except its quantization keys (`LOSSY_ZERO_KEY`), which change the arithmetic."""
LOSSY_ZERO_KEY = "quantiz"
SCHEDULE_LENGTH_KEYS = ("warmup_num_steps", "total_num_steps")
"""scheduler.params that follow the run's length: the default config derives its warm-up from --steps, so an
extended run recomputes them (and says so)."""
OUTPUTS = (METRICS_FILE, "summary.json", "loss.png", "pipeline_timeline.png", "pipeline_trace.json", CHECKPOINT_DIR)
"""What --overwrite removes: the earlier run's results (its logs/ stay: they are small and explain its end)."""

_TAG_STEP = re.compile(r"global_step(\d+)")


@dataclass(frozen=True)
class Decision:
    """How this launch uses RUN_DIR: `resume_step` None starts from step 0; `message` and then each of `notes`
    (what changed since the checkpoint: the schedule, the layout, the global batch) are said once."""

    resume_step: int | None
    message: str | None
    notes: tuple[str, ...] = ()


TagProblem = Callable[[Path], "str | None"]
"""A tag directory -> why it cannot be resumed from (missing, a file missing or cut short), one line naming the
file, or None (`shardwise.cli.resume.tag_problem`)."""

ScheduleNote = Callable[[dict[str, Any], dict[str, Any], int, int, int], str]
"""(config there, config now, steps there, steps now, checkpoint step) -> the one line saying what an extended
run's recomputed schedule means for its learning rate (`shardwise.cli.resume.schedule_note`)."""


def latest_step(run_dir: Path) -> tuple[str, int | None] | None:
    """(tag, its global step or None when the tag is not `global_stepN`) named by checkpoints/latest, or None."""
    latest = run_dir / CHECKPOINT_DIR / LATEST
    if not latest.is_file():
        return None
    try:
        tag = latest.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if not tag or "/" in tag or "\n" in tag or tag.startswith("."):
        raise UserError(f"{latest} does not name a checkpoint tag (it should hold one line such as global_step100)"
                        f"{_offer(run_dir, None)}")
    return tag, tag_step(tag)


def tag_step(tag: str) -> int | None:
    """The global step of a `global_stepN` tag, else None."""
    match = _TAG_STEP.fullmatch(tag)
    return int(match.group(1)) if match else None


def previous_complete(run_dir: Path, before: int | None, problem: TagProblem | None) -> str | None:
    """The newest `global_stepN` tag of the run with N < `before` (any N when None) that `problem` finds whole."""
    root = run_dir / CHECKPOINT_DIR
    tags = sorted(((tag_step(p.name), p.name) for p in root.iterdir() if p.is_dir() and tag_step(p.name) is not None)
                  if root.is_dir() else [], reverse=True)
    for step, tag in tags:
        assert step is not None
        if (before is None or step < before) and (problem is None or problem(root / tag) is None):
            return tag
    return None


def _offer(run_dir: Path, before: int | None, problem: TagProblem | None = None) -> str:
    """'; resume from ... with --resume-from TAG ...' when the run has an earlier complete tag, then --overwrite."""
    previous = previous_complete(run_dir, before, problem)
    again = (f"; resume from the previous complete checkpoint with --resume-from {previous} (the steps after it "
             f"are trained again), or pass --overwrite to start the run over") if previous is not None else \
        "; no earlier complete checkpoint is there: pass --overwrite to start the run over"
    return again


def _first_difference(before: Any, now: Any, path: str) -> str | None:
    """The first key path where two JSON values differ, as 'path: A there, B now'."""
    if isinstance(before, dict) and isinstance(now, dict):
        for key in sorted(set(before) | set(now), key=str):
            if key not in now or key not in before:
                where = "there" if key in before else "now"
                return f"{path}.{key} (only {where})".lstrip(".")
            diff = _first_difference(before[key], now[key], f"{path}.{key}")
            if diff is not None:
                return diff
        return None
    if before != now:
        return f"{path.lstrip('.')}: {json.dumps(before)} there, {json.dumps(now)} now"
    return None


def what_matters(config: Any, *, schedule_length: bool = True) -> Any:
    """The part of a config dict that changes what a run computes: without `LAYOUT_KEYS`, without the layout
    keys of zero_optimization, and (`schedule_length=False`) without the scheduler's length parameters."""
    if not isinstance(config, dict):
        return config
    kept = {k: v for k, v in config.items() if k not in LAYOUT_KEYS}
    zero = kept.pop("zero_optimization", None)
    if isinstance(zero, dict):
        lossy = {k: v for k, v in zero.items() if LOSSY_ZERO_KEY in k}
        if lossy:
            kept["zero_optimization"] = lossy
    scheduler = kept.get("scheduler")
    if not schedule_length and isinstance(scheduler, dict) and isinstance(scheduler.get("params"), dict):
        params = {k: v for k, v in scheduler["params"].items() if k not in SCHEDULE_LENGTH_KEYS}
        kept["scheduler"] = {**scheduler, "params": params}
    return kept


def identity_difference(earlier: dict[str, Any], now: dict[str, Any]) -> str | None:
    """None when `earlier` and `now` (WorkerArgs as dicts) are the same run, else the first difference. The
    scheduler's length may differ only when --steps did."""
    for field in IDENTITY:
        diff = _first_difference(earlier.get(field), now.get(field), field)
        if diff is not None:
            return diff
    same_length = earlier.get("steps") == now.get("steps")
    return _first_difference(what_matters(earlier.get("config"), schedule_length=same_length),
                             what_matters(now.get("config"), schedule_length=same_length), "config")


_UNSET: Any = object()       # a key one side lacks


def _leaf_changes(before: Any, now: Any, path: str) -> list[str]:
    """Every leaf that differs, as 'path A -> B' ('unset' where a key is missing)."""
    if isinstance(before, dict) and isinstance(now, dict):
        return [change for key in sorted(set(before) | set(now), key=str)
                for change in _leaf_changes(before.get(key, _UNSET), now.get(key, _UNSET), f"{path}.{key}")]
    if before == now:
        return []
    shown = ["unset" if v is _UNSET else json.dumps(v) for v in (before, now)]
    return [f"{path.lstrip('.')} {shown[0]} -> {shown[1]}"]


def layout_notes(earlier: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What a resumed run changes of the layout (one line) and of the global batch (one line), if anything."""
    def layout(config: Any) -> dict[str, Any]:
        config = config if isinstance(config, dict) else {}
        kept = {k: v for k, v in config.items() if k in LAYOUT_KEYS and k not in ("train_batch_size",)}
        zero = config.get("zero_optimization")
        if isinstance(zero, dict):
            kept["zero_optimization"] = {k: v for k, v in zero.items() if LOSSY_ZERO_KEY not in k}
        return kept

    notes = []
    changes = _leaf_changes(layout(earlier.get("config")), layout(now.get("config")), "")
    if changes:
        notes.append(f"at another layout than the checkpoint's (it reshards exactly): {'; '.join(changes)}")
    before, after = earlier.get("train_batch_size"), now.get("train_batch_size")
    if before is not None and after is not None and before != after:
        notes.append(f"the global batch changes from {before} to {after} sequences per step: the steps from here "
                     f"each train on {after}, so the run's later losses are not those of a run at {before}")
    return notes


def _has_results(run_dir: Path) -> bool:
    return (run_dir / METRICS_FILE).is_file() or (run_dir / CHECKPOINT_DIR).is_dir()


def _read_args(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def remove_outputs(run_dir: Path) -> list[str]:
    """Delete the earlier run's results (OUTPUTS); returns the names removed."""
    removed = []
    for name in OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def lock(run_dir: Path, name: str) -> IO[str]:
    """Hold RUN_DIR/NAME (one per node) for this process's life, so two commands never train into one directory
    at once (both would append to the metrics and write the same tags). UserError when another process holds it;
    the OS releases it when this process ends, however it ends."""
    import fcntl

    handle = open(run_dir / name, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UserError(f"--out {run_dir} is in use by another shardwise train ({holder}); wait for it to end "
                        f"or choose another --out.") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def decide(run_dir: Path, args_name: str, now: dict[str, Any], *, resume: bool, overwrite: bool,
           schedule_note: ScheduleNote | None = None, resume_from: str | None = None,
           tag_problem: TagProblem | None = None) -> Decision:
    """Start, resume or refuse (UserError, one line) a run described by `now` (WorkerArgs as a dict) in
    `run_dir`, whose earlier arguments are in `args_name`:

    - nothing worth keeping there (no metrics, no checkpoint): start from step 0;
    - the same run (same model, sequence length, corpus, seed and the config's keys that change what is computed,
      `what_matters`) with a checkpoint: resume from `latest` (automatic; `--resume` only insists on it), said in
      one line, with a line for each change: another `--steps` (the schedule recomputed: `schedule_note`),
      another layout (ZeRO stage, offload, tensor or pipeline parallel sizes, micro-batch and accumulation), another
      global batch;
    - the same run without a checkpoint, or another run: refused in one line, unless `overwrite`, which removes
      that run's outputs first (the user's explicit choice: the only path that deletes anything);
    - a `latest` naming a tag that is missing or damaged (`tag_problem`): refused in one line naming the file and
      offering the previous complete tag; `resume_from` TAG resumes from that tag (`latest` is pointed at it).
    """
    if (resume or resume_from is not None) and overwrite:
        flag = "--resume" if resume else "--resume-from"
        raise UserError(f"{flag} and --overwrite contradict each other: {flag} continues the run in --out, "
                        f"--overwrite replaces it; pass one of them.")
    where = str(run_dir)
    if not _has_results(run_dir):
        if resume or resume_from is not None:
            flag = "--resume" if resume else f"--resume-from {resume_from}"
            raise UserError(f"{flag}: {where} holds no checkpoint to resume from; leave it out to start "
                            f"the run there.")
        return Decision(None, None)
    if overwrite:
        removed = remove_outputs(run_dir)
        return Decision(None, f"--overwrite: removed the earlier run's {', '.join(removed)} from {where}")

    earlier = _read_args(run_dir / args_name)
    if earlier is None:
        raise UserError(f"--out {where} holds results of a run without its {args_name} (not a shardwise train run, "
                        f"or written by another node); choose another --out, or pass --overwrite to replace them.")
    diff = identity_difference(earlier, now)
    if diff is not None:
        raise UserError(f"--out {where} holds another run (different {diff}); choose another --out, or pass "
                        f"--overwrite to replace it.")
    if resume_from is not None:
        tag, step = resume_from, tag_step(resume_from)
        path = run_dir / CHECKPOINT_DIR / tag
        problem = (f"checkpoint {path} is missing" if not path.is_dir() or "/" in tag or tag.startswith(".")
                   else tag_problem(path) if tag_problem is not None else None)
        if problem is not None:
            raise UserError(f"--resume-from {tag}: {problem}{_offer(run_dir, step, tag_problem)}")
    else:
        latest = latest_step(run_dir)
        if latest is None:
            previous = previous_complete(run_dir, None, tag_problem)
            if previous is not None:
                raise UserError(f"--out {where} holds checkpoints of this run but no {CHECKPOINT_DIR}/{LATEST} "
                                f"naming one{_offer(run_dir, None, tag_problem)}.")
            raise UserError(f"--out {where} holds this run without a checkpoint to resume from (it ran without "
                            f"--save-every, or stopped before its first save); pass --overwrite to start it again, "
                            f"or choose another --out.")
        tag, step = latest
        path = run_dir / CHECKPOINT_DIR / tag
        problem = (f"checkpoint {path} named by {LATEST} is missing" if not path.is_dir()
                   else tag_problem(path) if tag_problem is not None else None)
        if problem is not None:
            raise UserError(f"--out {where}: {problem}{_offer(run_dir, step, tag_problem)}.")
    if step is not None and step >= now["steps"]:
        raise UserError(f"--out {where} has trained {step} steps already (checkpoint {tag}); --steps "
                        f"{now['steps']} is done: pass a larger --steps to train further.")
    notes = layout_notes(earlier, now)
    if schedule_note is not None and step is not None and earlier.get("steps") not in (None, now["steps"]):
        notes.insert(0, schedule_note(earlier.get("config") or {}, now["config"], int(earlier["steps"]),
                                      int(now["steps"]), step))
    message = f"resuming {where} from checkpoint {tag} (the same run: metrics.jsonl is appended to)"
    if resume_from is not None:
        latest_file = run_dir / CHECKPOINT_DIR / LATEST
        _point_latest(latest_file, tag)
        message = (f"resuming {where} from checkpoint {tag} (--resume-from; {LATEST} now names it, the later tags "
                   f"are replaced as the run reaches them, metrics rows after step {step} are set aside)")
    return Decision(step, message, tuple(notes))


def _point_latest(latest: Path, tag: str) -> None:
    """Replace `latest` with `tag` atomically (a temporary file renamed over it)."""
    tmp = latest.with_name(f".{latest.name}.tmp-{os.getpid()}")
    tmp.write_text(tag, encoding="utf-8")
    os.replace(tmp, latest)
