"""ZeRO-3's lifecycle as explicit states, each with the table of its legal transitions: a unit's `GatherState` and
`TrainingState` (FSDP2's `ShardedState` and `TrainingState`), a flat's `ReduceState` and the runtime's
`BackwardState`. Their owners (`params.Unit`, `flat.FlatShard`, `stage3.ZeroParamRuntime`) change them only
through `advance`, which refuses any transition its table does not list."""

from __future__ import annotations

import enum
from typing import Mapping, TypeVar


class GatherState(enum.Enum):
    """Where a unit's parameters are: FSDP2's `ShardedState` (named apart from the updater's checkpoint view,
    `parallel.interfaces.ShardedState`), plus the all-gather in flight between its two."""

    SHARDED = "sharded"        # only this rank's shard exists; the parameters are placeholders (see FlatShard)
    GATHERING = "gathering"    # the all-gather is launched (a prefetch) and not waited on yet
    UNSHARDED = "unsharded"    # the parameters view the whole gathered buffer


class TrainingState(enum.Enum):
    """What a unit's module is in the middle of (FSDP2's `TrainingState`)."""

    IDLE = "idle"
    FORWARD = "forward"                # between its forward pre-hook and post-hook
    PRE_BACKWARD = "pre_backward"      # the gradient of its outputs arrived: gathered again for its backward
    POST_BACKWARD = "post_backward"    # every gradient of its parameters arrived: freed, reduce-scatters launched


class ReduceState(enum.Enum):
    """Where a flat's gradients of the current backward are."""

    COLLECTING = "collecting"    # arriving into its [padded] buffer (none yet, some, or all while sync is off)
    REDUCING = "reducing"        # the reduce-scatter of that buffer is launched and not waited on yet
    REDUCED = "reduced"          # its result is added into grad_shard; COLLECTING again when the backward ends


class BackwardState(enum.Enum):
    """Whether the runtime owes a backward its end: the reduce-scatters no gradient launched, the wait for all of
    them, every unit freed."""

    NONE = "none"          # nothing to finish
    DUE = "due"            # a forward hooked its outputs; no backward has reached a hook yet (the engine's
                           # end_backward finishes one that never does)
    RUNNING = "running"    # a backward reached a hook and queued autograd's final callback, which finishes it


class ZeroParamStatus(enum.Enum):
    """A ZeRO-3 parameter's `GatherState` in DeepSpeed's terms and values: the `ds_status` each parameter of a
    ZeRO-3 model carries (`gathered.record_locations`)."""

    AVAILABLE = 1
    """Gathered whole on this rank (or persistent: always whole)."""
    NOT_AVAILABLE = 2
    """Only this rank's shard is held; the parameter is a 0-sized placeholder."""
    INFLIGHT = 3
    """A gather has been launched and not waited on yet."""


PARAM_STATUS = {GatherState.SHARDED: ZeroParamStatus.NOT_AVAILABLE, GatherState.GATHERING: ZeroParamStatus.INFLIGHT,
                GatherState.UNSHARDED: ZeroParamStatus.AVAILABLE}


GATHER_MOVES = {
    GatherState.SHARDED: {GatherState.GATHERING},
    GatherState.GATHERING: {GatherState.UNSHARDED},     # a free waits for the gather first
    GatherState.UNSHARDED: {GatherState.SHARDED},
}
TRAINING_MOVES = {
    # POST_BACKWARD from IDLE: gradients can arrive with no hook on the outputs (a reentrant checkpoint recomputes
    # the unit inside backward, where its post-hook adds none)
    TrainingState.IDLE: {TrainingState.FORWARD, TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD},
    # FORWARD again: the last forward raised before its post-hook
    TrainingState.FORWARD: {TrainingState.IDLE, TrainingState.FORWARD},
    # PRE_BACKWARD again: a module run twice in one forward gets one hook per call; IDLE: the backward ended
    # before all its parameters got gradients (some took no part)
    TrainingState.PRE_BACKWARD: {TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD, TrainingState.IDLE},
    TrainingState.POST_BACKWARD: {TrainingState.IDLE},
}
REDUCE_MOVES = {
    ReduceState.COLLECTING: {ReduceState.REDUCING},
    ReduceState.REDUCING: {ReduceState.REDUCED},
    ReduceState.REDUCED: {ReduceState.COLLECTING},
}
BACKWARD_MOVES = {
    BackwardState.NONE: {BackwardState.DUE, BackwardState.RUNNING},
    BackwardState.DUE: {BackwardState.RUNNING, BackwardState.NONE},
    BackwardState.RUNNING: {BackwardState.NONE},
}

S = TypeVar("S", bound=enum.Enum)


def advance(moves: Mapping[S, set[S]], now: S, to: S, owner: str) -> S:
    """`to`, once `moves` allows `now -> to`; otherwise an AssertionError naming `owner` and both states (a bug in
    the runtime's bookkeeping, not in what the user gave)."""
    if to not in moves[now]:
        allowed = ", ".join(sorted(s.name for s in moves[now]))
        raise AssertionError(f"{owner}: {now.name} -> {to.name} is not a legal transition (from {now.name} only to "
                             f"{allowed})")
    return to
