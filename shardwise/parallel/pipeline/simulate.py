"""The interpreter of pipeline programs: each stage's computes and point-to-point batches, run with times.

`simulate` / `check_schedule` run a schedule's programs in action order (`SendMode` says how sends are posted)
and return its `Timeline` (also built from a measured trace) or the `Deadlock` that stops it; `comm_plan` checks
its NCCL-safe programs with the same interpreter (`run_programs`), matching sends to receives by order.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable, Mapping, Sequence, Union

from shardwise.errors import UserError
from shardwise.parallel.pipeline.schedules import (
    Action, Message, Op, PipelineError, Transfer, infer_sizes, transfers, validate_schedule)

Number = Union[int, float, Fraction]


class SendMode(enum.StrEnum):
    """How a stage posts the send after an action and the receive before one.

    ASYNC (isend/irecv): a send never blocks; a receive waits until the data has arrived.
    BLOCKING (send/recv rendezvous): a send and its receive each block until the peer posts the other. Plain
    1F1B deadlocks this way for P >= 2, M >= 2 (stage 0 sends F1 while stage 1 sends B0).
    BATCHED: blocking, but the send after an action and the receive before the next action are posted together
    and waited on together (``dist.batch_isend_irecv`` + wait, Megatron's 1F1B pairing). Enough for GPipe and
    1F1B, not for interleaved 1F1B (Megatron batches both directions of a forward/backward pair there, which
    this mode does not model). The runtime posts `comm_plan`'s batches instead.
    """

    ASYNC = "async"
    BLOCKING = "blocking"
    BATCHED = "batched"


class Matching(enum.Enum):
    """How a receive finds its send."""

    BY_MESSAGE = "message"   # by tag (gloo): a receive takes the send of its own message
    BY_ORDER = "order"       # NCCL: between two stages, per direction, the k-th receive takes the k-th send


@dataclass(frozen=True)
class Compute:
    """Run the stage's action number ``index`` (its position in the stage's action list)."""

    index: int
    action: Action

    def __str__(self) -> str:
        return str(self.action)


@dataclass(frozen=True)
class Batch:
    """Point-to-point operations a stage posts together and waits on together (one ``batch_isend_irecv``)."""

    tick: int | None
    """The comm plan's grid tick it is posted at (`comm_plan`); None in a program made in action order."""
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]

    def __str__(self) -> str:
        parts = [f"send {t.message.op.value}{t.message.microbatch}@{t.message.source}->{t.peer}" for t in self.sends]
        parts += [f"recv {t.message.op.value}{t.message.microbatch}@{t.message.source}<-{t.peer}" for t in self.recvs]
        return f"[{'' if self.tick is None else f'{self.tick}: '}{', '.join(parts)}]"


Step = Union[Batch, Compute]


@dataclass(frozen=True)
class Costs:
    """Time of one micro-batch through a *whole* stage (all its V chunks); a chunk action takes 1/V of it.

    ``forward``/``backward`` are one number for every stage or one per stage; a stage's entry may also be a
    sequence of V numbers, the time of one micro-batch through each of its chunks (measured costs, where the
    chunk holding the head is heavier). ``actions`` gives the exact time of some actions, (stage, action) ->
    time, overriding the rest (a measured step replayed). ``latency`` is added to every point-to-point
    transfer between stages (not to hand-offs inside a stage).
    """

    forward: Number | Sequence[Number | Sequence[Number]] = 1
    backward: Number | Sequence[Number | Sequence[Number]] = 2
    latency: Number = 0
    actions: Mapping[tuple[int, Action], Number] | None = None

    def duration(self, op: Op, stage: int, num_stages: int, virtual_stages: int, chunk: int = 0) -> Number:
        value = self.forward if op is Op.FORWARD else self.backward
        name = op.name.lower()
        per_stage: Number | Sequence[Number]
        if isinstance(value, (int, float, Fraction)):
            per_stage = value
        else:
            if len(value) != num_stages:
                raise PipelineError(f"{name} costs: {len(value)} values for {num_stages} stages; "
                                    f"give one number or one per stage")
            per_stage = value[stage]
        if not isinstance(per_stage, (int, float, Fraction)):   # one value per chunk of the stage
            if len(per_stage) != virtual_stages:
                raise PipelineError(f"{name} costs of stage {stage}: {len(per_stage)} values for {virtual_stages} "
                                    f"chunk(s); give one number for the stage or one per chunk")
            per_chunk = per_stage[chunk]
            if per_chunk < 0:
                raise PipelineError(f"{name} cost of stage {stage} chunk {chunk} = {per_chunk}: costs must be >= 0")
            return Fraction(per_chunk) if isinstance(per_chunk, int) else per_chunk   # ints stay exact
        if per_stage < 0:
            raise PipelineError(f"{name} cost of stage {stage} = {per_stage}: costs must be >= 0")
        # ints stay exact: 3 / 2 -> Fraction(3, 2), not 1.5
        return Fraction(per_stage, virtual_stages) if isinstance(per_stage, int) else per_stage / virtual_stages


@dataclass(frozen=True)
class ActionRecord:
    """One action as it ran (or was simulated) on a stage."""

    stage: int
    action: Action
    start: Number
    end: Number


@dataclass(frozen=True)
class Timeline:
    """Start/end of every action of one pipeline step, simulated or measured, and its figures."""

    records: tuple[ActionRecord, ...]
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    name: str = ""
    """The schedule's name, for titles ("1f1b", "measured 1f1b", ...)."""

    @classmethod
    def from_records(cls, records: Iterable[ActionRecord | tuple[int, Action | str, Number, Number]], *,
                     num_stages: int | None = None, name: str = "measured") -> "Timeline":
        """A timeline from measured (stage, action, start, end) records, e.g. a real run's trace.

        Actions may be `Action`s or their text (``"F3"``, ``"B2.1"``); times in any unit.
        """
        rows = []
        for r in records:
            if not isinstance(r, ActionRecord):
                stage, action, start, end = r
                r = ActionRecord(int(stage), action if isinstance(action, Action) else Action.parse(action),
                                 start, end)
            if r.end < r.start:
                raise PipelineError(f"trace record {r.action} on stage {r.stage} ends ({r.end}) before it "
                                    f"starts ({r.start})")
            rows.append(r)
        if not rows:
            raise PipelineError("the trace has no records")
        stages = max(r.stage for r in rows) + 1 if num_stages is None else num_stages
        return cls(records=tuple(sorted(rows, key=lambda r: (r.stage, r.start))), num_stages=stages,
                   num_microbatches=max(r.action.microbatch for r in rows) + 1,
                   virtual_stages=max(r.action.chunk for r in rows) + 1, name=name)

    @functools.cached_property
    def _by_stage(self) -> dict[int, list[ActionRecord]]:
        rows: dict[int, list[ActionRecord]] = {s: [] for s in range(self.num_stages)}
        for r in sorted(self.records, key=lambda r: (r.start, r.end)):
            rows.setdefault(r.stage, []).append(r)
        return rows

    def stage_records(self, stage: int) -> list[ActionRecord]:
        """The stage's records in time order."""
        return list(self._by_stage.get(stage, []))

    @functools.cached_property
    def start(self) -> Number:
        return min(r.start for r in self.records)

    @functools.cached_property
    def makespan(self) -> Number:
        """From the first action's start to the last action's end, over all stages."""
        return max(r.end for r in self.records) - self.start

    def busy(self, stage: int) -> Number:
        return sum((r.end - r.start for r in self._by_stage.get(stage, [])), 0)

    def idle(self, stage: int) -> Number:
        return self.makespan - self.busy(stage)

    @property
    def bubble_fraction(self) -> Number:
        """Idle share of all stages' time: sum idle / (P * makespan), idle = makespan - busy. With equal stage
        costs and no latency (P-1)/(M+P-1) for GPipe and 1F1B, (P-1)/(V*M+P-1) for interleaved 1F1B with M >= P
        (`schedules.bubble_fraction` in general). The same information as the ratio: ratio / (1 + ratio)."""
        return sum(self.idle(s) for s in range(self.num_stages)) / (self.num_stages * self.makespan)

    @property
    def bubble_ratio(self) -> Number:
        """Idle over busy time, sum idle / sum busy (Narayanan's t_pb / t_id): (P-1)/M for GPipe and 1F1B with
        equal costs, that divided by V for interleaved 1F1B with M >= P (`schedules.bubble_ratio`)."""
        return sum(self.idle(s) for s in range(self.num_stages)) / sum(self.busy(s) for s in range(self.num_stages))

    def peak_in_flight(self, stage: int) -> int:
        """Most (micro-batch, chunk) activations the stage held at once: forwards done, backwards not.

        One unit is a micro-batch through one chunk (1/V of the stage's layers); with V = 1 it is a
        micro-batch of activations.
        """
        held = peak = 0
        for r in self.stage_records(stage):
            held += 1 if r.action.op is Op.FORWARD else -1
            peak = max(peak, held)
        return peak

    def order(self, stage: int) -> list[Action]:
        return [r.action for r in self.stage_records(stage)]


def replayed_costs(timeline: Timeline) -> Costs:
    """Every action of a measured timeline at its own measured duration: simulating under these costs gives the
    bubble of the very same computes with free, instant communication and no runtime work between actions."""
    return dataclasses.replace(measured_costs(timeline),
                               actions={(r.stage, r.action): r.end - r.start for r in timeline.records})


def measured_costs(timeline: Timeline) -> Costs:
    """The mean duration of a forward and of a backward on each (stage, chunk) of a measured timeline, as
    per-chunk `Costs`: simulating the schedule under them gives the bubble the formula would give with the
    stages' real (unequal) costs and free communication, the fair yardstick for a measured bubble."""
    sums: dict[tuple[Op, int, int], list[Number]] = {}
    for r in timeline.records:
        sums.setdefault((r.action.op, r.stage, r.action.chunk), []).append(r.end - r.start)

    def mean(op: Op, stage: int, chunk: int) -> Number:
        values = sums.get((op, stage, chunk))
        if not values:
            raise PipelineError(f"the trace has no {op.name.lower()} of stage {stage} chunk {chunk}")
        return sum(values) / len(values)

    chunks = range(timeline.virtual_stages)
    return Costs(forward=[[mean(Op.FORWARD, s, v) for v in chunks] for s in range(timeline.num_stages)],
                 backward=[[mean(Op.BACKWARD, s, v) for v in chunks] for s in range(timeline.num_stages)])


# ----- the interpreter -----

@dataclass(frozen=True)
class Deadlock:
    """Why a schedule cannot finish: the stages that wait on each other in a cycle."""

    mode: SendMode
    cycle: tuple[int, ...]
    """Stages in the order they wait on each other; the last waits on the first."""
    waits: tuple[str, ...]
    """For each stuck stage, what it is doing and what it waits for."""
    finished: tuple[ActionRecord, ...] = field(default=())

    def explain(self) -> str:
        hint = {SendMode.BLOCKING: "post sends asynchronously (isend) or batch each send with the next receive",
                SendMode.BATCHED: "post sends asynchronously (isend)",
                SendMode.ASYNC: "reorder the stage lists so each input is produced before it is needed"}[self.mode]
        ring = " -> ".join(f"stage {s}" for s in (*self.cycle, self.cycle[0]))
        return f"deadlock with {self.mode.value} sends ({ring}): " + "; ".join(self.waits) + f". Fix: {hint}"


class DeadlockError(UserError, RuntimeError):
    def __init__(self, deadlock: Deadlock):
        super().__init__(deadlock.explain())
        self.deadlock = deadlock


def _programs(schedule: Sequence[Sequence[Action]], mode: SendMode) -> list[list[Step]]:
    """Each stage's program in action order: [receive] compute [send] per action, as the runtime would post
    them one by one; BATCHED merges a send with the next receive. Hand-offs inside a stage need no batch."""
    num_stages, _, virtual = infer_sizes(schedule)
    programs = []
    for stage, actions in enumerate(schedule):
        steps: list[Step] = []
        for index, action in enumerate(actions):
            t = transfers(action, stage=stage, num_stages=num_stages, virtual_stages=virtual)
            if t.recv is not None and not t.recv_local:
                last = steps[-1] if steps else None
                if mode is SendMode.BATCHED and isinstance(last, Batch) and not last.recvs:
                    steps[-1] = Batch(None, last.sends, (t.recv,))
                else:
                    steps.append(Batch(None, (), (t.recv,)))
            steps.append(Compute(index, action))
            if t.send is not None and not t.send_local:
                steps.append(Batch(None, (t.send,), ()))
        programs.append(steps)
    return programs


def check_schedule(schedule: Sequence[Sequence[Action]], *, costs: Costs = Costs(),
                   mode: SendMode | str = SendMode.ASYNC, name: str = "") -> Timeline | Deadlock:
    """Run the schedule with sends posted as ``mode`` says; the timeline if it can finish, else the deadlock."""
    mode = SendMode(mode)
    validate_schedule(schedule)
    return run_programs(_programs(schedule, mode), costs=costs, mode=mode, name=name)


def simulate(schedule: Sequence[Sequence[Action]], *, costs: Costs = Costs(),
             mode: SendMode | str = SendMode.ASYNC, name: str = "") -> Timeline:
    """The timeline of ``schedule`` under ``costs``; raises `DeadlockError` if it cannot finish."""
    result = check_schedule(schedule, costs=costs, mode=mode, name=name)
    if isinstance(result, Deadlock):
        raise DeadlockError(result)
    return result


_Key = tuple[Any, ...]
"""A posted send or receive: (is_send, message) when matched by message, (is_send, src, dst, k) by order."""


@dataclass(frozen=True)
class _Posted:
    key: _Key
    transfer: Transfer
    is_send: bool


def run_programs(programs: Sequence[Sequence[Step]], *, costs: Costs = Costs(), mode: SendMode = SendMode.ASYNC,
                 matching: Matching = Matching.BY_MESSAGE, name: str = "") -> Timeline | Deadlock:
    """Run every stage's program; the timeline if all finish, else the deadlock that stops them. The programs'
    computes, stage by stage, are a valid schedule (`validate_schedule`; the callers check it).

    A stage runs its steps in order. A compute starts when its stage is free (its remote input was received by
    an earlier batch; a hand-off inside the stage must have been produced) and lasts its cost. A batch posts its
    sends and receives at the stage's clock and completes when each operation met its peer's: under ASYNC a
    send at once and a receive when the data has arrived (its send + latency); otherwise each when both sides
    posted (the later post + latency). Times follow max-plus rules, so they do not depend on the order the
    loop visits stages; integer or Fraction costs give exact figures.

    Raises `PipelineError` where a program is wrong whatever the timing: a send before its stage computed the
    message, a compute before a batch received its input, a send or receive that no peer operation matches,
    and under BY_ORDER a k-th send that is not the message of the k-th receive it meets (NCCL has no tags).
    """
    num_stages, num_microbatches, virtual = infer_sizes(
        [[s.action for s in steps if isinstance(s, Compute)] for steps in programs])
    durations = [{(op, v): costs.duration(op, stage, num_stages, virtual, v) for op in Op for v in range(virtual)}
                 for stage in range(num_stages)]
    clock: list[Number] = [0] * num_stages
    pc = [0] * num_stages
    waiting: list[list[_Posted] | None] = [None] * num_stages   # the posted batch a stage waits on
    posted: dict[_Key, Number] = {}                             # operation -> time its stage posted it
    queues: dict[tuple[bool, int, int], list[Message]] = {}     # (is_send, src, dst) -> messages in posting order
    handed: set[tuple[int, Message]] = set()                    # hand-offs inside a stage, produced
    produced: list[set[Message]] = [set() for _ in range(num_stages)]
    received: list[set[Message]] = [set() for _ in range(num_stages)]
    records: list[ActionRecord] = []

    def post(stage: int, t: Transfer, is_send: bool) -> _Posted:
        src, dst = (stage, t.peer) if is_send else (t.peer, stage)
        mine = queues.setdefault((is_send, src, dst), [])
        theirs = queues.get((not is_send, src, dst), [])
        k = len(mine)
        mine.append(t.message)
        key: _Key = (is_send, t.message)
        if matching is Matching.BY_ORDER:
            if len(theirs) > k and theirs[k] != t.message:
                sent, wanted = (t.message, theirs[k]) if is_send else (theirs[k], t.message)
                raise PipelineError(f"stages {src} -> {dst}: send number {k} is the {sent} but the receive it "
                                    f"meets is for the {wanted} (NCCL matches by order, not by tag)")
            key = (is_send, src, dst, k)
        posted[key] = clock[stage]
        return _Posted(key, t, is_send)

    def completion(op: _Posted) -> Number | None:
        mine, theirs = posted[op.key], posted.get(_peer_key(op.key))
        if mode is SendMode.ASYNC:
            if op.is_send:
                return mine
            return None if theirs is None else max(mine, theirs + costs.latency)
        return None if theirs is None else max(mine, theirs) + costs.latency

    progress = True
    while progress:
        progress = False
        for stage in range(num_stages):
            while pc[stage] < len(programs[stage]):
                step = programs[stage][pc[stage]]
                if isinstance(step, Compute):
                    action = step.action
                    t = transfers(action, stage=stage, num_stages=num_stages, virtual_stages=virtual)
                    if t.recv is not None and t.recv_local and (stage, t.recv.message) not in handed:
                        break   # its input comes from a later action of the same stage: stuck
                    if t.recv is not None and not t.recv_local and t.recv.message not in received[stage]:
                        raise PipelineError(f"stage {stage} runs {action} before receiving its input "
                                            f"{t.recv.message}")
                    exact = costs.actions.get((stage, action)) if costs.actions else None
                    start = clock[stage]
                    clock[stage] = start + (durations[stage][(action.op, action.chunk)] if exact is None else exact)
                    records.append(ActionRecord(stage, action, start, clock[stage]))
                    if t.send is not None and t.send_local:
                        handed.add((stage, t.send.message))
                    elif t.send is not None:
                        produced[stage].add(t.send.message)
                else:
                    ops = waiting[stage]
                    if ops is None:   # post the batch once
                        for s in step.sends:
                            if s.message not in produced[stage]:
                                raise PipelineError(f"stage {stage} sends the {s.message} before computing it")
                        ops = [post(stage, s, True) for s in step.sends] + [post(stage, r, False) for r in step.recvs]
                        waiting[stage] = ops
                    done = [when for when in map(completion, ops) if when is not None]
                    if len(done) < len(ops):
                        break   # the stage waits here until its peers post their side
                    clock[stage] = max([clock[stage], *done])
                    received[stage].update(r.message for r in step.recvs)
                    waiting[stage] = None
                pc[stage] += 1
                progress = True
    if any(pc[s] < len(programs[s]) for s in range(num_stages)):
        return _explain(programs, pc, waiting, posted, mode, tuple(records), num_stages, virtual)
    _check_all_matched(queues)
    return Timeline(records=tuple(sorted(records, key=lambda r: (r.stage, r.start))), num_stages=num_stages,
                    num_microbatches=num_microbatches, virtual_stages=virtual, name=name)


def _peer_key(key: _Key) -> _Key:
    """The operation that meets ``key``: the other side of the same message, or of the same place in order."""
    return (not key[0], *key[1:])


def _check_all_matched(queues: dict[tuple[bool, int, int], list[Message]]) -> None:
    """Between every two stages, per direction, as many sends as receives (each receive that completed met
    its own send, so equal counts mean every send was taken)."""
    for src, dst in sorted({(src, dst) for _, src, dst in queues}):
        sends, recvs = queues.get((True, src, dst), []), queues.get((False, src, dst), [])
        if len(sends) != len(recvs):
            raise PipelineError(f"stage {src} posts {len(sends)} send(s) to stage {dst}, which posts "
                                f"{len(recvs)} receive(s)")


def _explain(programs: Sequence[Sequence[Step]], pc: list[int], waiting: list[list[_Posted] | None],
             posted: dict[_Key, Number], mode: SendMode, finished: tuple[ActionRecord, ...], num_stages: int,
             virtual: int) -> Deadlock:
    """Name what each stuck stage waits for and follow the waits to a cycle."""
    waits_on: dict[int, int] = {}
    text: dict[int, str] = {}
    for stage, steps in enumerate(programs):
        if pc[stage] == len(steps):
            continue
        step = steps[pc[stage]]
        if isinstance(step, Compute):   # only a hand-off inside the stage stops a compute
            t = transfers(step.action, stage=stage, num_stages=num_stages, virtual_stages=virtual)
            waits_on[stage] = stage
            text[stage] = (f"stage {stage} runs {step.action} before the same stage produces its input "
                           f"({t.recv.message if t.recv is not None else 'none'})")
            continue
        where = _where(steps, pc[stage])
        for op in sorted(waiting[stage] or (), key=lambda op: op.is_send):   # receives first
            if (mode is SendMode.ASYNC and op.is_send) or _peer_key(op.key) in posted:
                continue   # async sends never wait; this one is matched
            message, peer = op.transfer.message, op.transfer.peer
            verb = f"send the {message} to" if op.is_send else f"receive the {message} from"
            waits_on.setdefault(stage, peer)
            text.setdefault(stage, f"stage {stage} ({where}) waits to {verb} stage {peer}")
    # Every stuck stage waits on a stuck stage, so walking the waits from any of them meets a cycle.
    seen: list[int] = []
    stage = min(waits_on)
    while stage in waits_on and stage not in seen:
        seen.append(stage)
        stage = waits_on[stage]
    cycle = tuple(seen[seen.index(stage):]) if stage in seen else tuple(seen)
    return Deadlock(mode=mode, cycle=cycle, waits=tuple(text[s] for s in cycle), finished=finished)


def _where(steps: Sequence[Step], at: int) -> str:
    """Where batch ``at`` sits: after the compute whose output it sends, else before the compute it feeds."""
    batch = steps[at]
    assert isinstance(batch, Batch)
    before = [s for s in steps[:at] if isinstance(s, Compute)]
    after = [s for s in steps[at + 1:] if isinstance(s, Compute)]
    if batch.sends and before:
        return f"after {before[-1]}"
    return f"before {after[0]}" if after else f"after {before[-1]}" if before else "at its start"
