"""Kills one rank of a launched `shardwise train` after a given step: the fault the survive tests inject (and, with
SHARDWISE_TEST_EXTRA_COLLECTIVE_AT, makes one rank run an extra collective: the desync test's fault).

Python imports `sitecustomize` at start-up from the first folder of its path that holds one; the
`kill_rank_after_step` fixture (tests/conftest.py) puts this folder first on PYTHONPATH and sets
SHARDWISE_TEST_KILL_AT="R:S". torchrun's agent starts each rank as a new process that inherits that
environment, so each rank runs this file; without the variable it does nothing.

The rank whose global RANK is R, on the first attempt only (TORCHELASTIC_RESTART_COUNT 0: a restarted attempt
runs through), kills itself with SIGKILL, as `kill -9` or the kernel's OOM killer would, once step S is done:
where the step loop of `shardwise.cli.train_worker.train` ends an iteration. That is after `StopRequest.agreed`
(the ranks' agreement whether a signal asked them to stop, the loop's last call) returns, unless the ranks agreed
to stop before the last step, when the loop leaves without finishing the iteration. The loop's step number and
its number of steps are those it passed to `NodeLog.step` earlier in the same iteration. So every rank has
finished step S (its metrics row, its checkpoint if one was due) before rank R dies.
"""

from __future__ import annotations

import os

KILL_ENV = "SHARDWISE_TEST_KILL_AT"
STALL_ENV = "SHARDWISE_TEST_STALL_AT"
""""R:S": rank R stops answering after step S instead (sleeps; a frozen node or a stuck data read)."""


def _kill_after_step(step: int, *, stall: bool = False) -> None:
    """Wrap the two calls of the worker's step loop that mark the step and its end (see the module docstring)."""
    import signal
    import sys

    from shardwise.cli.stop import StopRequest
    from shardwise.telemetry.node_log import NodeLog

    loop: dict[str, int] = {}       # the step the loop is in, and its number of steps

    log_step = NodeLog.step
    agreed = StopRequest.agreed

    def step_logged(self, at: int, total: int, *args, **kwargs):
        loop.update(step=at, total=total)
        return log_step(self, at, total, *args, **kwargs)

    def agreed_then_maybe_killed(self, *args, **kwargs):
        signum = agreed(self, *args, **kwargs)
        if loop.get("step") == step and not (signum and step < loop["total"]):
            sys.stdout.flush()
            if stall:
                import time
                time.sleep(3600)          # the launcher's signals still end it
            os.kill(os.getpid(), signal.SIGKILL)
        return signum

    NodeLog.step = step_logged
    StopRequest.agreed = agreed_then_maybe_killed


def _install() -> None:
    stall = STALL_ENV in os.environ
    spec = os.environ.get(STALL_ENV if stall else KILL_ENV)
    if not spec or "RANK" not in os.environ or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return          # not asked, not a rank (torchrun's agent, the launching process) or a restarted attempt
    rank, step = (int(x) for x in spec.split(":"))
    if int(os.environ["RANK"]) == rank:
        _kill_after_step(step, stall=stall)


EXTRA_COLLECTIVE_ENV = "SHARDWISE_TEST_EXTRA_COLLECTIVE_AT"
""""R:S": global rank R makes one extra all-reduce of 3 floats with torch.distributed itself (no shardwise ledger
sees it) in step S, before the step's first backward: its peers meet it with their first gradient bucket.
"R:S:ledger": the same all-reduce through shardwise's `Comm` on the world group, recorded in the engine's ledger
as the data-parallel group's ("dp"), as a strategy's extra collective would be."""


def _extra_collective_in_step(step: int, *, recorded: bool) -> None:
    import torch
    import torch.distributed as dist

    from shardwise.comm.collectives import Comm
    from shardwise.engine.step import TrainingSteps

    backward = TrainingSteps.backward
    done: list[bool] = []

    def backward_after_an_extra_collective(self, *args, **kwargs):
        if self.global_steps + 1 == step and not done:     # global_steps: the steps completed before this one
            done.append(True)
            if recorded:
                Comm(None, self.ledger, name="dp").all_reduce(torch.ones(3))
            else:
                dist.all_reduce(torch.ones(3))
        return backward(self, *args, **kwargs)

    TrainingSteps.backward = backward_after_an_extra_collective


def _install_extra_collective() -> None:
    spec = os.environ.get(EXTRA_COLLECTIVE_ENV)
    if not spec or "RANK" not in os.environ:
        return
    rank, step, *how = spec.split(":")
    if int(os.environ["RANK"]) == int(rank):
        _extra_collective_in_step(int(step), recorded=how == ["ledger"])


_install()
_install_extra_collective()
