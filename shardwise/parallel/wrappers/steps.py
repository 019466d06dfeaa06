"""Training steps of a wrapped model, for its `comm_report()`: the wrappers see no `optimizer.step()`, so a step
is told from the forwards (`StepClock`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.comm.ledger import CommLedger


@dataclass(eq=False)
class StepClock:
    """Moves `ledger` on to the next step at the forward that follows a synchronizing one.

    A forward with grad enabled whose backward will synchronize gradients (outside `no_sync()`, with
    `set_requires_gradient_sync(True)`) is the last of its step; the next such forward opens the next step in the
    wrappers' `CommLedger`. Micro-batches of gradient accumulation thus share one step, and what runs between a
    step's backward and the next forward (clipping, a state dict) counts in that step. A forward without grad
    after a complete step (evaluation) is a step of its own. Steps are numbered from 0 as the engine's are; the
    collectives of wrapping itself (DDP's broadcasts of rank 0's weights) fall in step -1."""

    ledger: CommLedger
    closes: bool = True
    """The last forward's backward synchronizes: it ends a step, and the next forward opens one."""

    def __post_init__(self) -> None:
        self.ledger.begin_step(-1)

    def forward_started(self, synchronizes: bool) -> None:
        """Call before a forward with grad enabled does anything else (before its first all-gather)."""
        if self.closes:
            self.ledger.begin_step(self.ledger.step + 1)
        self.closes = bool(synchronizes)

    def eval_forward_started(self) -> None:
        """A forward without grad (evaluation) has no backward: after a complete step it is a step of its own
        (so an evaluation-only loop keeps the ledger bounded), inside an accumulating one it joins that."""
        if self.closes:
            self.ledger.begin_step(self.ledger.step + 1)

    def last_complete_step(self) -> int:
        """The newest step whose synchronizing forward has run (its backward, once run, completes it)."""
        return self.ledger.step if self.closes else self.ledger.step - 1

    def report(self, step: int | None = None) -> list[dict[str, Any]]:
        """The engine's `comm_report()` rows for `step` (default: the last complete step)."""
        return self.ledger.report(self.last_complete_step() if step is None else step)
