"""How the ranks of `shardwise train` tell the launcher why they ended, in a few lines instead of tracebacks.

Each rank that fails writes RUN_DIR/logs/LAUNCH/rankR.attemptA.json (LAUNCH: one `shardwise train` command; A:
torchrun's restart count), and for an unexpected exception its full traceback to rankR.attemptA.log beside it.
Global rank 0 of a run stopped by a signal writes stopped.json there after its checkpoint. The launcher reads
them once the ranks are gone:

- a user error (UserError, ConfigError, CorpusError) on any rank: its line(s), exit code 2;
- a hang (a `CollectiveTimeout` on any rank): the verdict's one line, which leads with the ranks that stalled,
  after the crashes reported before it (their cause, if any); the ranks the agent then killed (the stalled ones
  among them) and the others' follow-on errors are consequences, not listed;
- otherwise one line per rank torchrun saw fail, first the ranks killed by a signal (a rank that dies takes its
  peers' collectives down with it, so their errors are consequences), then the others with their exception's
  last line and the path of its traceback; the ranks that failed after them are counted, not listed.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from shardwise.errors import UserError

USER = "user"
CRASH = "crash"
STOPPED_FILE = "stopped.json"
EXIT_USER_ERROR = 2
EXIT_CRASH = 1
MAX_LISTED = 3
HANG = "CollectiveTimeout: "
"""How a crash report of a hang starts: its exception's name, then the watchdog's verdict."""
LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "recvValue failed",
             "Socket closed", "Connection refused")
"""What a rank's collective or store call says when a peer process is gone (gloo, TCPStore)."""


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """Why one rank ended (one JSON file)."""

    rank: int
    attempt: int
    kind: str                 # USER or CRASH
    message: str              # a user error's text (one line per problem), or the exception's last line
    time: float               # time.time() when written: orders the crashes
    log: str | None = None    # the full traceback of a crash


@dataclass(frozen=True)
class ProcessExit:
    """What torchrun saw of a failed rank: its exit code (negative: killed by that signal) and pid."""

    exitcode: int
    pid: int


def is_user_error(error: BaseException) -> bool:
    """A user error to report as such; not another rank's failed save, whose own report says why."""
    from shardwise.checkpoint.files import SaveFailedElsewhere
    from shardwise.data import CorpusError

    return isinstance(error, (UserError, CorpusError)) and not isinstance(error, SaveFailedElsewhere)


def write_failure(folder: Path, *, rank: int, attempt: int, error: BaseException) -> RankReport:
    """Record `error` (being handled) for the launcher: a user error's text, or a crash's last line and traceback."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"rank{rank}.attempt{attempt}"
    if is_user_error(error):
        report = RankReport(rank=rank, attempt=attempt, kind=USER, message=str(error).strip() or type(error).__name__,
                            time=time.time())
    else:
        text = "".join(traceback.format_exception(error))
        log = folder / f"{stem}.log"
        log.write_text(text, encoding="utf-8")
        said = [line.strip() for line in str(error).splitlines() if line.strip()]
        last = f"{type(error).__name__}: {said[-1]}" if said else type(error).__name__
        report = RankReport(rank=rank, attempt=attempt, kind=CRASH, message=last, time=time.time(), log=str(log))
    _write_json(folder / f"{stem}.json", asdict(report))
    return report


def write_stopped(folder: Path, *, signum: int, step: int, checkpoint: str) -> None:
    """Global rank 0, after the checkpoint of a run stopped by signal `signum` at `step`."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / STOPPED_FILE, {"signal": signum, "step": step, "checkpoint": checkpoint})


def read_stopped(folder: Path) -> dict | None:
    try:
        return json.loads((folder / STOPPED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_reports(folder: Path) -> list[RankReport]:
    """The reports of the last attempt that wrote any (earlier attempts were restarted past)."""
    reports = []
    for path in sorted(folder.glob("rank*.attempt*.json")) if folder.is_dir() else []:
        try:
            reports.append(RankReport(**json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError, TypeError):
            continue       # a rank killed while writing it: its exit code still speaks for it
    if not reports:
        return []
    last = max(r.attempt for r in reports)
    return [r for r in reports if r.attempt == last]


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def failure_lines(reports: Iterable[RankReport], exits: dict[int, ProcessExit], folder: Path) -> tuple[int, list[str]]:
    """The exit code and the lines the launcher prints for a failed run (see the module docstring)."""
    reports = sorted(reports, key=lambda r: r.time)
    users = [r for r in reports if r.kind == USER]
    if users:
        lines = list(dict.fromkeys(line.strip() for line in users[0].message.splitlines() if line.strip()))
        return EXIT_USER_ERROR, [f"shardwise: error: {line}" for line in lines]
    hangs = [r for r in reports if r.kind == CRASH and r.message.startswith(HANG)]
    if hangs:
        # The timeout fired while every rank was alive: the agent's kills came after it (of the stalled ranks too).
        before = [r for r in reports if r.kind == CRASH and r.time < hangs[0].time and not r.message.startswith(HANG)
                  and not any(m in r.message for m in LOST_PEER)]
        return EXIT_CRASH, [f"shardwise: rank {r.rank} failed: {r.message} (traceback: {r.log})"
                            for r in before[:MAX_LISTED]] + \
            [f"shardwise: {hangs[0].message[len(HANG):]} (reports in {folder})"]
    by_rank = {r.rank: r for r in reports}
    killed = sorted(rank for rank, e in exits.items() if e.exitcode < 0 and rank not in by_rank)
    # A rank killed by a signal takes its peers' connections (and, rank 0, the store) with it: their "connection
    # reset" crashes are its consequence, said on its line rather than as failures of their own.
    lost = sorted(r.rank for r in reports if killed and r.kind == CRASH and any(m in r.message for m in LOST_PEER))
    failed = killed + [r.rank for r in reports if r.rank in exits] + sorted(set(exits) - set(by_rank) - set(killed))
    failed += [r.rank for r in reports if r.rank not in failed]    # reported, but after torchrun saw the failure
    failed = [rank for rank in failed if rank not in lost]
    lines = []
    for rank in failed[:MAX_LISTED]:
        report, code = by_rank.get(rank), exits.get(rank)
        if report is not None:
            lines.append(f"shardwise: rank {rank} failed: {report.message} (traceback: {report.log})")
        elif code is not None and code.exitcode < 0:
            then = (f"; rank(s) {', '.join(map(str, lost))} then lost their connection to it (tracebacks in "
                    f"{folder})") if lost and rank == killed[0] else ""
            lines.append(f"shardwise: rank {rank} was killed by {signal_name(-code.exitcode)} (pid {code.pid}){then}")
        elif code is not None:
            lines.append(f"shardwise: rank {rank} exited with code {code.exitcode} (pid {code.pid})")
    if len(failed) > MAX_LISTED:
        lines.append(f"shardwise: {len(failed) - MAX_LISTED} more rank(s) failed after them; reports in {folder}")
    return EXIT_CRASH, lines or ["shardwise: the ranks failed without a report"]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data) + "\n", encoding="utf-8")
    os.replace(tmp, path)
