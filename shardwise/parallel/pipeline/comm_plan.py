"""When each stage posts its sends and receives: programs of computes and point-to-point batches that are safe
under NCCL's matching rules (and so under gloo's, which are looser), built from a lockstep tick grid
(`build_programs`) and checked by running them in the simulator's interpreter under those rules
(`check_programs`). Pure: no torch.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from shardwise.parallel.pipeline.schedules import Action, PipelineError, Transfer, transfers, validate_schedule
from shardwise.parallel.pipeline.simulate import (
    Batch, Compute, Costs, Deadlock, Matching, SendMode, Step, Timeline, run_programs, simulate)

__all__ = ["Batch", "Compute", "Step", "build_programs", "check_programs", "format_program", "tick_grid"]


def tick_grid(schedule: Sequence[Sequence[Action]]) -> Timeline:
    """The schedule simulated with one tick per chunk action (asynchronous sends, no latency): integer times."""
    _, _, virtual = validate_schedule(schedule)
    # Costs are per whole stage and split over the V chunks: V per stage is one tick per chunk action.
    return simulate(schedule, costs=Costs(forward=virtual, backward=virtual), mode=SendMode.ASYNC, name="grid")


def build_programs(schedule: Sequence[Sequence[Action]]) -> list[list[Step]]:
    """Every stage's program: its actions in order, and between them the batches of sends and receives it posts.

    Why a plan at all. NCCL ignores tags: between two ranks, the k-th send in one direction meets the k-th
    receive the peer posted from that rank, whatever it was meant for. And a rank's p2p operations run on a
    stream in the order they were issued, each send waiting until the peer's matching receive runs, so a rank
    whose stream holds ``send A; recv B`` and a peer holding ``send B; recv A`` hang (gloo, with tags and
    buffered sends, would not). Deriving the posting order from each stage's own action list (receive before
    the action, send after it) is not enough: unbatched, a 1F1B pair does exactly the hang above; and at P = 2
    with interleaved 1F1B both directions carry activations *and* gradients, and with uneven micro-batch groups
    (M = 5) the order in which one stage produces them differs from the order in which the other needs them.

    The rule: a lockstep grid. `tick_grid` simulates the schedule with every chunk action lasting exactly one
    tick (asynchronous sends, no latency), so every action starts at an integer tick, a stage runs at most one
    action per tick, and an action's input was produced at an earlier tick than the action starts. Each stage's
    program is, tick after tick,

        Batch(T): the send of the output of its action that ended at T, plus the receives of every message a
                  neighbour sends at T   (one ``dist.batch_isend_irecv``: one NCCL group)
        Compute:  its action that starts at T (its input was received in a batch at a tick <= T)

    Why this cannot deadlock or mismatch, under the strictest model (every batch is a rendezvous that blocks its
    rank until all of its operations met their peers' operations; `check_programs` runs exactly this model):
    - Order. The sender posts a message in its batch at tick T and the receiver posts its receive in its batch
      at the same tick T; a stage sends at most one message per tick, so between two stages, per direction,
      sends and receives are posted in the same order (by tick): the k-th send meets the k-th receive.
    - Progress, by induction on T. If every batch before tick T completed, every action starting before T had
      its input (received at a tick <= its start), so it ran and every stage reaches its batch at T. The
      batches at T of all stages match each other exactly (a message sent at T is received at T), so they all
      complete.
    The same order is what the runtime executes with gloo (tag 0 everywhere), so the CPU tests exercise it. Only
    the posting order is lockstep: a receive is waited on right before the action that needs it, and a send is
    never waited on by the compute thread, so with real (unequal) costs no stage waits for the grid.

    Hand-offs between chunks of one stage (P = 1) need no batch; a stage with nothing to send or receive at a
    tick has no batch there.
    """
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
    validate_schedule(schedule)
    for stage, (actions, steps) in enumerate(zip(schedule, programs)):
        ran = [s.action for s in steps if isinstance(s, Compute)]
        if ran != list(actions):
            raise PipelineError(f"stage {stage}: the program computes {ran}, not the schedule's {list(actions)}")
    result = run_programs(programs, mode=SendMode.BATCHED, matching=Matching.BY_ORDER)
    if isinstance(result, Deadlock):
        raise PipelineError(f"the p2p programs deadlock under NCCL's rules: {'; '.join(result.waits)}")
