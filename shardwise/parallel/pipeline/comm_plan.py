"""When each stage posts its sends and receives: a program of computes and point-to-point batches that is
safe under NCCL's matching rules (and therefore under gloo's, which are looser). Pure: no torch.

Why a plan at all. NCCL ignores tags: between two ranks, the k-th send in one direction meets the k-th receive
the peer posted from that rank, whatever it was meant for. And a rank's p2p operations run on a stream in the
order they were issued, each send waiting until the peer's matching receive runs, so a rank whose stream holds
``send A; recv B`` and a peer holding ``send B; recv A`` hang (gloo, with tags and buffered sends, would not).
Deriving the posting order from each stage's own action list (receive before the action, send after it) is not
enough: unbatched, a 1F1B pair does exactly the hang above; and at P = 2 with interleaved 1F1B both directions
carry activations *and* gradients, and with uneven micro-batch groups (M = 5) the order in which one stage
produces them differs from the order in which the other needs them.

The rule: a lockstep grid. `tick_grid` simulates the schedule with every chunk action lasting exactly one tick
(asynchronous sends, no latency), so every action starts at an integer tick, a stage runs at most one action
per tick, and an action's input was produced at an earlier tick than the action starts. Each stage's program
is, tick after tick,

    Batch(T): the send of the output of its action that ended at T, plus the receives of every message a
              neighbour sends at T   (one ``dist.batch_isend_irecv``: one NCCL group)
    Compute:  its action that starts at T (its input was received in a batch at a tick <= T)

Why this cannot deadlock or mismatch, under the strictest model (every batch is a rendezvous that blocks its
rank until all of its operations met their peers' operations; `check_programs` runs exactly this model):
- Order. The sender posts a message in its batch at tick T and the receiver posts its receive in its batch at
  the same tick T; a stage sends at most one message per tick, so between two stages, per direction, sends
  and receives are posted in the same order (by tick): the k-th send meets the k-th receive, tags or not.
- Progress, by induction on T. If every batch before tick T completed, every action starting before T had
  its input (received at a tick <= its start), so it ran and every stage reaches its batch at T. The batches
  at T of all stages match each other exactly (a message sent at T is received at T), so they all complete.
The same order is what the runtime executes with gloo (tag 0 everywhere), so the CPU tests exercise it.

Only the posting order is lockstep: a receive is waited on right before the action that needs it, and a
send is never waited on by the compute thread, so with real (unequal) costs no stage waits for the grid.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence, Union

from shardwise.parallel.pipeline.schedules import (
    Action, Message, PipelineError, Transfer, transfers, validate_schedule)
from shardwise.parallel.pipeline.simulate import Costs, SendMode, Timeline, simulate


@dataclass(frozen=True)
class Batch:
    """The point-to-point operations a stage posts together at ``tick``."""

    tick: int
    sends: tuple[Transfer, ...]
    """Output of the stage's action that ended at ``tick`` (at most one message)."""
    recvs: tuple[Transfer, ...]
    """Messages that neighbours send at ``tick`` to this stage (at most one per neighbour)."""

    def __str__(self) -> str:
        parts = [f"send {t.message.op.value}{t.message.microbatch}@{t.message.source}->{t.peer}" for t in self.sends]
        parts += [f"recv {t.message.op.value}{t.message.microbatch}@{t.message.source}<-{t.peer}" for t in self.recvs]
        return f"[{self.tick}: {', '.join(parts)}]"


@dataclass(frozen=True)
class Compute:
    """Run the stage's action number ``index`` (its position in the stage's action list)."""

    index: int
    action: Action

    def __str__(self) -> str:
        return str(self.action)


Step = Union[Batch, Compute]


def tick_grid(schedule: Sequence[Sequence[Action]]) -> Timeline:
    """The schedule simulated with one tick per chunk action (asynchronous sends, no latency): integer times."""
    _, _, virtual = validate_schedule(schedule)
    # Costs are per whole stage and split over the V chunks: V per stage is one tick per chunk action.
    return simulate(schedule, costs=Costs(forward=virtual, backward=virtual), mode=SendMode.ASYNC, name="grid")


def build_programs(schedule: Sequence[Sequence[Action]]) -> list[list[Step]]:
    """Every stage's program (see the module docstring). Hand-offs between chunks of one stage (P = 1) need
    no batch; a stage with nothing to send or receive at a tick has no batch there."""
    num_stages, _, virtual = validate_schedule(schedule)
    grid = tick_grid(schedule)
    index = {(s, a): i for s, actions in enumerate(schedule) for i, a in enumerate(actions)}
    sends: dict[tuple[int, int], list[Transfer]] = defaultdict(list)   # (stage, tick) -> what it sends
    recvs: dict[tuple[int, int], list[Transfer]] = defaultdict(list)   # (stage, tick) -> what it receives
    starts: dict[tuple[int, int], Compute] = {}                        # (stage, tick) -> the action starting
    for r in grid.records:
        start, end = _tick(r.start), _tick(r.end)
        starts[(r.stage, start)] = Compute(index[(r.stage, r.action)], r.action)
        t = transfers(r.action, stage=r.stage, num_stages=num_stages, virtual_stages=virtual)
        if t.send is not None and not t.send_local:
            sends[(r.stage, end)].append(t.send)
            recvs[(t.send.peer, end)].append(Transfer(t.send.message, r.stage))
    last = _tick(grid.makespan)
    programs: list[list[Step]] = []
    for stage in range(num_stages):
        steps: list[Step] = []
        for tick in range(last + 1):
            out, into = sends.get((stage, tick), []), sorted(recvs.get((stage, tick), []), key=lambda t: t.peer)
            if out or into:
                steps.append(Batch(tick, tuple(out), tuple(into)))
            if (stage, tick) in starts:
                steps.append(starts[(stage, tick)])
        programs.append(steps)
    return programs


def _tick(value: object) -> int:
    tick = int(value)   # type: ignore[call-overload]
    if tick != value:
        raise AssertionError(f"tick grid time {value} is not an integer")   # unit costs give integer times
    return tick


def format_program(steps: Sequence[Step]) -> str:
    return " ".join(map(str, steps))


def check_programs(schedule: Sequence[Sequence[Action]], programs: Sequence[Sequence[Step]]) -> None:
    """Run ``programs`` under NCCL's rules, strictly: matching by order per direction between two stages (no
    tags), every batch blocking its stage until each of its operations met the peer's; each remote input
    received in a batch before its action. Raises `PipelineError` naming the first mismatch or the stuck
    stages. Every stage's computes must be its action list, in order."""
    num_stages, _, virtual = validate_schedule(schedule)
    for stage, (actions, steps) in enumerate(zip(schedule, programs)):
        ran = [s.action for s in steps if isinstance(s, Compute)]
        if ran != list(actions):
            raise PipelineError(f"stage {stage}: the program computes {ran}, not the schedule's {list(actions)}")
    # posted[(src, dst)]: messages src posted as sends to dst, in order; taken[(src, dst)]: receives dst posted.
    posted: dict[tuple[int, int], list[Message]] = defaultdict(list)
    taken: dict[tuple[int, int], list[Message]] = defaultdict(list)
    pc = [0] * num_stages
    issued: list[dict[int, list[tuple[tuple[int, int], int, bool]]]] = [{} for _ in range(num_stages)]
    received: list[set[Message]] = [set() for _ in range(num_stages)]
    produced: list[set[Message]] = [set() for _ in range(num_stages)]

    def matched(key: tuple[int, int], k: int, is_send: bool) -> bool:
        return len(taken[key] if is_send else posted[key]) > k

    progress = True
    while progress:
        progress = False
        for stage in range(num_stages):
            while pc[stage] < len(programs[stage]):
                step = programs[stage][pc[stage]]
                if isinstance(step, Compute):
                    t = transfers(step.action, stage=stage, num_stages=num_stages, virtual_stages=virtual)
                    if t.recv is not None and not t.recv_local and t.recv.message not in received[stage]:
                        raise PipelineError(f"stage {stage} runs {step.action} before receiving its input "
                                            f"{t.recv.message}")
                    if t.send is not None and not t.send_local:
                        produced[stage].add(t.send.message)
                else:
                    ops = issued[stage].setdefault(pc[stage], [])
                    if not ops:   # post the batch once
                        for s in step.sends:
                            if s.message not in produced[stage]:
                                raise PipelineError(f"stage {stage} sends the {s.message} before computing it")
                            ops.append(_post(posted, taken, (stage, s.peer), s.message, True))
                        for r in step.recvs:
                            ops.append(_post(taken, posted, (r.peer, stage), r.message, False))
                    if not all(matched(key, k, is_send) for key, k, is_send in ops):
                        break   # a rendezvous: the stage waits here until every peer posted its side
                    received[stage].update(r.message for r in step.recvs)
                pc[stage] += 1
                progress = True
    stuck = [s for s in range(num_stages) if pc[s] < len(programs[s])]
    if stuck:
        where = "; ".join(f"stage {s} at {programs[s][pc[s]]}" for s in stuck)
        raise PipelineError(f"the p2p programs deadlock under NCCL's rules: {where}")
    for key in set(posted) | set(taken):
        if len(posted[key]) != len(taken[key]):
            raise PipelineError(f"stage {key[0]} posts {len(posted[key])} send(s) to stage {key[1]}, which posts "
                                f"{len(taken[key])} receive(s)")


def _post(mine: dict[tuple[int, int], list[Message]], theirs: dict[tuple[int, int], list[Message]],
          key: tuple[int, int], message: Message, is_send: bool) -> tuple[tuple[int, int], int, bool]:
    """Append ``message`` to this side's queue for the (src, dst) pair ``key``; the k-th send must be the
    message the k-th receive is for (NCCL matches by order, not by tag)."""
    k = len(mine[key])
    mine[key].append(message)
    if len(theirs[key]) > k and theirs[key][k] != message:
        sent, wanted = (message, theirs[key][k]) if is_send else (theirs[key][k], message)
        raise PipelineError(f"stages {key[0]} -> {key[1]}: send number {k} is the {sent} but the receive it meets "
                            f"is for the {wanted} (NCCL matches by order, not by tag)")
    return key, k, is_send
