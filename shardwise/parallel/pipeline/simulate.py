"""A discrete-event simulator for pipeline schedules, and the measured-trace form of the same timeline.

Every stage walks its action list in order, one action at a time. Before an action it receives its
input from the neighbouring model chunk and after it sends its output on (`schedules.transfers`),
exactly as the runtime does. How a send behaves is the :class:`SendMode`:

- ASYNC (isend/irecv): a send never blocks; a receive waits until the data has arrived.
- BLOCKING (send/recv rendezvous): a send and its receive each block until the peer posts the other.
  Plain 1F1B deadlocks this way for P >= 2, M >= 2 (stage 0 sends F1 while stage 1 sends B0).
- BATCHED: blocking, but the send after an action and the receive before the next action are posted
  together and waited on together (``dist.batch_isend_irecv`` + wait, Megatron's 1F1B pairing).
  Enough for GPipe and 1F1B, not for interleaved 1F1B (Megatron batches both directions of a
  forward/backward pair there, which this mode does not model). The runtime should use ASYNC.

Times follow max-plus rules (an action starts when its stage is free and its input has arrived),
so they do not depend on the order in which the loop visits stages. Give integer or Fraction costs
to get exact figures. A schedule that cannot finish is reported as a :class:`Deadlock` naming the
cycle of waiting stages.

Bubble conventions. With idle(s) = makespan - busy(s):
- ``bubble_fraction`` = sum idle / (P * makespan): share of the total time. Equal stage costs, no
  latency: (P-1)/(M+P-1) for GPipe and 1F1B, (P-1)/(V*M+P-1) for interleaved 1F1B with M >= P.
- ``bubble_ratio`` = sum idle / sum busy: Narayanan's t_pb / t_id. (P-1)/M for GPipe and 1F1B and
  exactly that divided by V, (P-1)/(V*M), for interleaved 1F1B with M >= P.
The two carry the same information: fraction = ratio / (1 + ratio). `schedules.bubble_fraction` and
`schedules.bubble_ratio` give the closed forms (also for interleaved with M < P).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable, Mapping, Sequence, Union

from shardwise.errors import UserError
from shardwise.parallel.pipeline.schedules import (
    Action, Message, Op, PipelineError, Transfer, transfers, validate_schedule)

Number = Union[int, float, Fraction]


class SendMode(enum.StrEnum):
    ASYNC = "async"
    BLOCKING = "blocking"
    BATCHED = "batched"


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
        """Idle share of all stages' time: sum idle / (P * makespan)."""
        return sum(self.idle(s) for s in range(self.num_stages)) / (self.num_stages * self.makespan)

    @property
    def bubble_ratio(self) -> Number:
        """Idle over busy time, sum idle / sum busy (Narayanan's t_pb / t_id)."""
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


# ----- the simulation -----

@dataclass(frozen=True)
class _Compute:
    action: Action
    duration: Number
    local_input: Message | None   # produced earlier on this same stage (P = 1 with V > 1)
    local_output: Message | None  # consumed later on this same stage


@dataclass(frozen=True)
class _Exchange:
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    after: Action | None   # the action whose output is sent, for explanations
    before: Action | None  # the action whose input is received


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


def _programs(schedule: Sequence[Sequence[Action]], costs: Costs, mode: SendMode,
              sizes: tuple[int, int, int]) -> list[list[_Compute | _Exchange]]:
    """Each stage's steps: [recv] compute [send] per action; BATCHED merges a send with the next recv."""
    num_stages, _, virtual = sizes
    durations = [{(op, v): costs.duration(op, stage, num_stages, virtual, v) for op in Op for v in range(virtual)}
                 for stage in range(num_stages)]
    programs = []
    for stage, actions in enumerate(schedule):
        steps: list[_Compute | _Exchange] = []
        for action in actions:
            t = transfers(action, stage=stage, num_stages=num_stages, virtual_stages=virtual)
            if t.recv is not None and not t.recv_local:
                last = steps[-1] if steps else None
                if mode is SendMode.BATCHED and isinstance(last, _Exchange) and not last.recvs:
                    steps[-1] = _Exchange(last.sends, (t.recv,), last.after, action)
                else:
                    steps.append(_Exchange((), (t.recv,), None, action))
            exact = costs.actions.get((stage, action)) if costs.actions else None
            steps.append(_Compute(action, durations[stage][(action.op, action.chunk)] if exact is None else exact,
                                  t.recv.message if t.recv_local else None,
                                  t.send.message if t.send_local else None))
            if t.send is not None and not t.send_local:
                steps.append(_Exchange((t.send,), (), action, None))
        programs.append(steps)
    return programs


def check_schedule(schedule: Sequence[Sequence[Action]], *, costs: Costs = Costs(),
                   mode: SendMode | str = SendMode.ASYNC, name: str = "") -> Timeline | Deadlock:
    """Run the schedule's dependency graph; the timeline if it can finish, else the deadlock."""
    mode = SendMode(mode)
    sizes = validate_schedule(schedule)
    num_stages = sizes[0]
    programs = _programs(schedule, costs, mode, sizes)
    clock: list[Number] = [0] * num_stages
    pc = [0] * num_stages
    local_ready: dict[tuple[int, Message], Number] = {}  # hand-offs inside a stage: producer's end
    posted: dict[tuple[bool, Message], Number] = {}        # (is_send, message) -> time its stage posted it
    records: list[ActionRecord] = []

    def completion(is_send: bool, message: Message) -> Number | None:
        mine, theirs = posted[(is_send, message)], posted.get((not is_send, message))
        if mode is SendMode.ASYNC:
            if is_send:
                return mine
            return None if theirs is None else max(mine, theirs + costs.latency)
        return None if theirs is None else max(mine, theirs) + costs.latency

    progress = True
    while progress:
        progress = False
        for stage in range(num_stages):
            while pc[stage] < len(programs[stage]):
                step = programs[stage][pc[stage]]
                if isinstance(step, _Compute):
                    if step.local_input is not None and (stage, step.local_input) not in local_ready:
                        break
                    start = clock[stage]
                    clock[stage] = start + step.duration
                    records.append(ActionRecord(stage, step.action, start, clock[stage]))
                    if step.local_output is not None:
                        local_ready[(stage, step.local_output)] = clock[stage]
                else:
                    ops = [(True, s.message) for s in step.sends] + [(False, r.message) for r in step.recvs]
                    for op in ops:
                        posted.setdefault(op, clock[stage])
                    done = [completion(*op) for op in ops]
                    if any(d is None for d in done):
                        break
                    clock[stage] = max([clock[stage], *done])
                pc[stage] += 1
                progress = True
    if all(pc[s] == len(programs[s]) for s in range(num_stages)):
        return Timeline(records=tuple(sorted(records, key=lambda r: (r.stage, r.start))), num_stages=num_stages,
                        num_microbatches=sizes[1], virtual_stages=sizes[2], name=name)
    return _explain(programs, pc, posted, mode, tuple(records))


def simulate(schedule: Sequence[Sequence[Action]], *, costs: Costs = Costs(),
             mode: SendMode | str = SendMode.ASYNC, name: str = "") -> Timeline:
    """The timeline of ``schedule`` under ``costs``; raises `DeadlockError` if it cannot finish."""
    result = check_schedule(schedule, costs=costs, mode=mode, name=name)
    if isinstance(result, Deadlock):
        raise DeadlockError(result)
    return result


def _explain(programs: list[list[_Compute | _Exchange]], pc: list[int], posted: dict[tuple[bool, Message], Number],
             mode: SendMode, finished: tuple[ActionRecord, ...]) -> Deadlock:
    """Name what each stuck stage waits for and follow the waits to a cycle."""
    waits_on: dict[int, int] = {}
    text: dict[int, str] = {}
    for stage, steps in enumerate(programs):
        if pc[stage] == len(steps):
            continue
        step = steps[pc[stage]]
        if isinstance(step, _Compute):
            waits_on[stage] = stage
            text[stage] = (f"stage {stage} runs {step.action} before the same stage produces its input "
                           f"({step.local_input})")
            continue
        for is_send, items in ((False, step.recvs), (True, step.sends)):
            for item in items:
                if mode is SendMode.ASYNC and is_send:
                    continue  # async sends never wait
                if (not is_send, item.message) in posted:
                    continue  # matched
                where = f"after {step.after}" if step.after else f"before {step.before}"
                verb = f"send the {item.message} to" if is_send else f"receive the {item.message} from"
                waits_on.setdefault(stage, item.peer)
                text.setdefault(stage, f"stage {stage} ({where}) waits to {verb} stage {item.peer}")
    # Every stuck stage waits on a stuck stage, so walking the waits from any of them meets a cycle.
    seen: list[int] = []
    stage = min(waits_on)
    while stage in waits_on and stage not in seen:
        seen.append(stage)
        stage = waits_on[stage]
    cycle = tuple(seen[seen.index(stage):]) if stage in seen else tuple(seen)
    return Deadlock(mode=mode, cycle=cycle, waits=tuple(text[s] for s in cycle), finished=finished)
