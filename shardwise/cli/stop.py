"""SIGTERM and SIGINT inside a rank: the first asks the run to stop at the next step boundary, the second ends the
rank at once.

`shardwise train` forwards a signal it receives to every local rank (torch's elastic agent does, as `kill`,
`docker stop`, schedulers and Ctrl-C expect). Each rank notes the first one (`StopRequest`); after every step the
ranks agree (`StopRequest.agreed`) whether any rank was asked to stop, so all of them take the same decision at the
same step, save one checkpoint together and leave.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from shardwise.comm.sequence import SequenceCheck

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The first stop signal this rank received (0: none)."""

    def __init__(self) -> None:
        self.signum = 0
        self._count = 0

    def install(self) -> "StopRequest":
        """Catch SIGTERM and SIGINT from now on. Call once, from the main thread.

        A rank blocked in a collective (a peer died or hangs) never returns to Python, and Python runs signal
        handlers only in the main thread between bytecodes. So the handler is a no-op, and a watcher thread reads
        the signal numbers from `signal.set_wakeup_fd`, which the interpreter's C-level handler writes from
        whichever thread the kernel interrupts: the second signal ends the process (exit code 128 + signal) even
        then.
        """
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)       # the C handler must never block
        for sig in STOP_SIGNALS:
            signal.signal(sig, _ignore)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="shardwise-stop", daemon=True).start()
        _term_when_parent_dies()
        return self

    def _watch(self, read_fd: int) -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum in STOP_SIGNALS:
                    self.note(signum)

    def note(self, signum: int) -> None:
        """Record a stop signal: the first asks for a stop, the second exits now."""
        self._count += 1
        if self._count == 1:
            self.signum = signum
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)

    def agreed(self, vote: SequenceCheck | None) -> int:
        """The signal any rank was stopped by (the largest number), 0 if none, the same on every rank: the engine's
        stop vote (`SequenceCheck.agree_stop`, on the guards' communicator; None in a world of one)."""
        return vote.agree_stop(self.signum) if vote is not None else self.signum


def _term_when_parent_dies() -> None:
    """Linux: SIGTERM this rank when its launcher dies (even by kill -9), so it saves and stops instead of
    training on as an orphan in its own session. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return


def _ignore(signum: int, frame: object) -> None:
    """Python-level no-op: the watcher thread acts on the signal (see `StopRequest.install`)."""
