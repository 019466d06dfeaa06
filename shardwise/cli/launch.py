"""Run torch's elastic launcher (torchrun) inside `shardwise train` and say in a few lines how the ranks ended.

torchrun as a child process printed its own tracebacks (40-150 lines for one user error, a kill -9 or a
Ctrl-C) and exited 1 for all of them. Run in this process (`launch`), its outcomes are exceptions caught here.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from shardwise.cli.rank_reports import ProcessExit, failure_lines, read_reports, read_stopped, signal_name

STOP_GRACE_S = 120
"""Seconds the ranks get after a signal to finish their step and save before the agent kills them (SIGKILL);
TORCH_ELASTIC_SHUTDOWN_TIMEOUT overrides it. A second signal ends the ranks at once."""
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _quiet_agent_logs() -> None:
    """Silence the agent's own log lines: they repeat, in more words, what the report says."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _early_signal(signum: int, frame: FrameType | None) -> None:
    """Until the agent installs its own handlers (same behaviour): a signal during the rendezvous ends it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"got {signal_name(signum)}", sigval=signal.Signals(signum))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or "no message"


def stop_grace_args() -> list[str]:
    return [] if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ else ["--shutdown-timeout", str(STOP_GRACE_S)]


def launch(torchrun_argv: list[str], *, reports: Path, run_dir: Path) -> int:
    """Run `torchrun torchrun_argv` in this process; returns the exit code of `shardwise train`:

    - the ranks finished: exit 0; or, when a signal sent to the ranks themselves stopped them, 128 + signal;
    - SignalException (SIGTERM, SIGINT to this process): the agent has already forwarded the signal to every local
      rank (they are in their own sessions, so the terminal's Ctrl-C reaches them only this way) and waited up to
      the stop grace for them to finish their step and save; exit 128 + signal (143, 130), after one line saying
      which checkpoint to resume from;
    - ChildFailedError (a rank failed and no restart is left): the ranks' reports (`rank_reports`) give one line
      for a user error (exit 2) or a short report of the failed ranks (exit 1);
    - RendezvousError (the nodes never met): one line, exit 1.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    _quiet_agent_logs()
    # torch shares the rendezvous store with the ranks across restarts without a per-attempt prefix: restarted
    # ranks then read the dead attempt's gloo addresses and wait forever. Unshared, rank 0 of every attempt
    # hosts a fresh store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    previous = {sig: signal.signal(sig, _early_signal) for sig in _SIGNALS}
    try:
        run(parse_args(torchrun_argv))
        _quiet_agent_logs()        # (loggers created while running)
    except SignalException as e:
        return _stopped(reports, run_dir, int(e.sigval))
    except ChildFailedError as e:
        exits = {rank: ProcessExit(f.exitcode, f.pid) for rank, f in e.failures.items()}
        code, lines = failure_lines(read_reports(reports), exits, reports)
        print("\n".join(lines), file=sys.stderr, flush=True)
        return code
    except RendezvousError as e:
        # The nodes never met (a node not started, another address or port): not a crash of ours.
        print(f"shardwise: the ranks could not meet ({type(e).__name__}: {_one_line(e)}); start every node with the "
              f"same --nnodes, --master-addr and --master-port", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stopped = read_stopped(reports)
    return 0 if stopped is None else _stopped(reports, run_dir, int(stopped["signal"]))


def _stopped(reports: Path, run_dir: Path, signum: int) -> int:
    """Say where a run stopped by `signum` can resume from; returns 128 + signum."""
    stopped = read_stopped(reports)
    name = signal_name(signum)
    if stopped is not None:
        print(f"shardwise: {name}: stopped after step {stopped['step']} and saved {stopped['checkpoint']}; run the "
              f"same command to resume", file=sys.stderr, flush=True)
    else:
        from shardwise.cli.run_dir import latest_step
        latest = latest_step(run_dir)
        where = f"its last checkpoint is {run_dir / 'checkpoints' / latest[0]}" if latest else "it has no checkpoint"
        # Before the first step ended, during the last one, or past the grace: nothing saved for this signal.
        print(f"shardwise: {name}: the ranks ended without a stop checkpoint; {where}", file=sys.stderr, flush=True)
    return 128 + signum
