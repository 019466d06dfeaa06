"""Pipeline schedules as pure data: each stage's ordered list of forward/backward actions, and each schedule's
bubble in closed form. A schedule says *what* a stage computes and in which order, never how it communicates:
the runtime and the simulator derive every send and receive from the stage's position (`transfers`). No torch
here: the planner imports this module.
"""

from __future__ import annotations

import difflib
import enum
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from shardwise.config import PipelineSchedule
from shardwise.errors import UserError

ActionTable = list[list["Action"]]
"""For each stage, its actions in order: what a schedule kind (`PipelineSchedule`) builds for given sizes."""


class PipelineError(UserError, ValueError):
    """A pipeline request that cannot be honoured (bad sizes, unknown names); the message names the fix."""


class Op(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    """Forward or backward of one micro-batch on one of the stage's local model chunks.

    Model chunks. With ``virtual_stages`` V the model is cut into P * V contiguous model chunks; local chunk
    ``v`` of stage ``p`` holds model chunk ``v * P + p`` (Megatron's interleaved layout), so a micro-batch goes
    round the stages V times. With V = 1 the chunk is always 0.

    Text form. ``str(Action)`` is ``F<microbatch>`` / ``B<microbatch>`` for chunk 0 and
    ``F<microbatch>.<chunk>`` for a later local chunk: ``F3`` is the forward of micro-batch 3 on the stage's
    first chunk, ``B3.1`` the backward of micro-batch 3 on its second. :meth:`parse` reads it back.
    """

    op: Op
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        base = f"{self.op.value}{self.microbatch}"
        return base if self.chunk == 0 else f"{base}.{self.chunk}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``"F3"`` -> Action(FORWARD, 3), ``"B2.1"`` -> Action(BACKWARD, 2, chunk=1)."""
        match = re.fullmatch(r"\s*([FB])(\d+)(?:\.(\d+))?\s*", text)
        if match is None:
            raise PipelineError(f"cannot read action {text!r}: write F<microbatch> or B<microbatch>, "
                                f"optionally .<chunk>, e.g. 'F3' or 'B2.1'")
        return cls(Op(match[1]), int(match[2]), int(match[3] or 0))

    def model_chunk(self, *, stage: int, num_stages: int) -> int:
        """Index of this action's model chunk in the whole model (0 .. P*V-1)."""
        return self.chunk * num_stages + stage


def format_actions(actions: Sequence[Action]) -> str:
    """``"F0 F1 B0 ..."``: the form golden tests and the CLI print."""
    return " ".join(map(str, actions))


# ----- validation shared by the schedule functions -----

def _check_sizes(num_stages: int, stage: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    if num_stages < 1:
        raise PipelineError(f"pipeline stages = {num_stages}: needs at least 1 stage")
    if not 0 <= stage < num_stages:
        raise PipelineError(f"stage = {stage} is outside 0..{num_stages - 1} for {num_stages} stage(s)")
    if num_microbatches < 1:
        raise PipelineError(f"micro-batches = {num_microbatches}: a pipeline needs at least 1 micro-batch "
                            f"(it is gradient_accumulation_steps); set it to >= 1")
    if virtual_stages < 1:
        raise PipelineError(f"virtual_stages = {virtual_stages}: needs at least 1 model chunk per stage")


def parse_schedule_kind(name: str | PipelineSchedule) -> PipelineSchedule:
    """The schedule enum for ``name``; an unknown name is an error suggesting the closest valid one."""
    if isinstance(name, PipelineSchedule):
        return name
    try:
        return PipelineSchedule(name.strip().lower())
    except ValueError:
        valid = [k.value for k in PipelineSchedule]
        close = difflib.get_close_matches(name.strip().lower(), valid, n=1, cutoff=0.4)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PipelineError(f"pipeline schedule = {name!r} is unknown; valid: {', '.join(valid)}{hint}") from None


# ----- the schedules -----

def gpipe(*, num_stages: int, stage: int, num_microbatches: int) -> list[Action]:
    """All M forwards, then all M backwards (in the same micro-batch order). Holds M activations."""
    _check_sizes(num_stages, stage, num_microbatches)
    return ([Action(Op.FORWARD, m) for m in range(num_microbatches)]
            + [Action(Op.BACKWARD, m) for m in range(num_microbatches)])


def one_f_one_b(*, num_stages: int, stage: int, num_microbatches: int) -> list[Action]:
    """1F1B (PipeDream-Flush): warm up with P - stage - 1 forwards, alternate F/B, drain the backwards.

    Stage s holds at most min(P - s, M) micro-batches of activations (Megatron's warm-up rule).
    """
    _check_sizes(num_stages, stage, num_microbatches)
    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [Action(Op.FORWARD, m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        actions += [Action(Op.FORWARD, warmup + i), Action(Op.BACKWARD, i)]
    actions += [Action(Op.BACKWARD, m) for m in range(num_microbatches - warmup, num_microbatches)]
    return actions


def interleaved_groups(*, num_stages: int, num_microbatches: int) -> list[int]:
    """Sizes of the micro-batch groups of the interleaved schedule, in order.

    M // P groups (one group of M when M < P), as even as possible with the larger ones first, so
    every group has at least P micro-batches. When P divides M these are Megatron's groups of P
    (``microbatch_group_size_per_vp_stage`` = P). Megatron refuses other M ("the last group
    introduces dependency bubbles") and torch.distributed.pipelining needs M to be a multiple of
    max(1, M // P); spreading the remainder over the groups instead keeps the bubble at exactly the
    formula for every M >= P (checked in tests/unit/test_pipeline_simulate.py).
    """
    count = max(1, num_microbatches // num_stages)
    base, extra = divmod(num_microbatches, count)
    return [base + 1] * extra + [base] * (count - extra)


def interleaved_order(*, num_stages: int, num_microbatches: int, virtual_stages: int) -> list[tuple[int, int]]:
    """The (microbatch, chunk) order of every stage's forwards in the interleaved schedule.

    Each group of micro-batches runs through chunk 0, then chunk 1, ... before the next group
    starts (depth first within a group). The k-th backward takes the k-th entry with the chunk
    reversed (chunk V-1 first), as Megatron's ``get_schedule_table`` does.
    """
    order, first = [], 0
    for size in interleaved_groups(num_stages=num_stages, num_microbatches=num_microbatches):
        order += [(m, v) for v in range(virtual_stages) for m in range(first, first + size)]
        first += size
    return order


def interleaved_warmup(*, num_stages: int, stage: int, num_microbatches: int, virtual_stages: int) -> int:
    """Forwards before the first backward on ``stage``: 2(P - s - 1) + (V - 1) * G, capped at M * V.

    G is the largest group (P when P divides M): a backward of chunk v must not come before the
    forward it needs, which is (V - 1 - 2v) * G places later in the order.
    """
    group = max(interleaved_groups(num_stages=num_stages, num_microbatches=num_microbatches))
    return min(2 * (num_stages - stage - 1) + (virtual_stages - 1) * group, num_microbatches * virtual_stages)


def interleaved_one_f_one_b(*, num_stages: int, stage: int, num_microbatches: int,
                            virtual_stages: int) -> list[Action]:
    """Megatron's interleaved 1F1B: V model chunks per stage, depth first in groups of micro-batches.

    Local chunk v of stage p is model chunk v * P + p. Warm up with `interleaved_warmup` forwards,
    alternate one forward and one backward, drain the backwards. Any M >= 1 works (see
    `interleaved_groups`); the bubble shrinks by V only when M >= P. V = 1 is plain `one_f_one_b`.

    Activations held on stage s: at most min(warm-up + 1, M * V) chunk activations, each 1/V of the
    stage's layers; for P | M that is 2(P - s - 1) + (V - 1) P + 1, a little more than 1F1B's P - s
    micro-batches' worth once divided by V.
    """
    _check_sizes(num_stages, stage, num_microbatches, virtual_stages)
    if virtual_stages == 1:  # one chunk: plain 1F1B (its warm-up is P - s - 1, not 2(P - s - 1))
        return one_f_one_b(num_stages=num_stages, stage=stage, num_microbatches=num_microbatches)
    order = interleaved_order(num_stages=num_stages, num_microbatches=num_microbatches,
                              virtual_stages=virtual_stages)
    total = len(order)  # M * V forwards and as many backwards

    def forward(k: int) -> Action:
        m, v = order[k]
        return Action(Op.FORWARD, m, v)

    def backward(k: int) -> Action:
        m, v = order[k]
        return Action(Op.BACKWARD, m, virtual_stages - 1 - v)

    warmup = interleaved_warmup(num_stages=num_stages, stage=stage, num_microbatches=num_microbatches,
                                virtual_stages=virtual_stages)
    actions = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [forward(warmup + i), backward(i)]
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions


def build_schedule(kind: str | PipelineSchedule, *, num_stages: int, num_microbatches: int,
                   virtual_stages: int = 1) -> ActionTable:
    """Every stage's action list for the named schedule ("gpipe", "1f1b", "interleaved_1f1b").

    ``virtual_stages`` > 1 needs "interleaved_1f1b"; "interleaved_1f1b" with V = 1 is plain 1F1B.
    """
    schedule = parse_schedule_kind(kind)
    _check_sizes(num_stages, 0, num_microbatches, virtual_stages)
    if virtual_stages > 1 and schedule is not PipelineSchedule.INTERLEAVED_1F1B:
        raise PipelineError(f"virtual_stages = {virtual_stages} needs schedule 'interleaved_1f1b' "
                            f"(got {schedule.value!r}); use it or set virtual_stages to 1")
    if schedule is PipelineSchedule.INTERLEAVED_1F1B:
        return [interleaved_one_f_one_b(num_stages=num_stages, stage=s, num_microbatches=num_microbatches,
                                        virtual_stages=virtual_stages) for s in range(num_stages)]
    build = gpipe if schedule is PipelineSchedule.GPIPE else one_f_one_b
    return [build(num_stages=num_stages, stage=s, num_microbatches=num_microbatches) for s in range(num_stages)]


# ----- the bubble in closed form -----

def bubble_microbatches(kind: str | PipelineSchedule, *, num_stages: int, num_microbatches: int,
                        virtual_stages: int = 1) -> Fraction:
    """Idle time of each stage, in micro-batch times t (one micro-batch's forward + backward through a stage),
    with equal stage costs and free communication: what `simulate` reproduces exactly with equal costs.

    Filling and draining take P - 1 slots of t / V. Interleaved with M < P, a group of M micro-batches also
    waits P - M slots at each of its V - 1 returns to the first stage: ((P - 1) + (V - 1) max(0, P - M)) / V.
    Not interleaved: V = 1 (Huang et al. 2019, GPipe; Narayanan et al. 2021, section 2.2).
    """
    _check_sizes(num_stages, 0, num_microbatches, virtual_stages)
    v = virtual_stages if parse_schedule_kind(kind) is PipelineSchedule.INTERLEAVED_1F1B else 1
    return Fraction(num_stages - 1 + (v - 1) * max(0, num_stages - num_microbatches), v)


def bubble_ratio(kind: str | PipelineSchedule, *, num_stages: int, num_microbatches: int,
                 virtual_stages: int = 1) -> Fraction:
    """Idle over busy time (Narayanan's t_pb / t_id): (P-1)/M; interleaved with M >= P, (P-1)/(V*M)."""
    return bubble_microbatches(kind, num_stages=num_stages, num_microbatches=num_microbatches,
                               virtual_stages=virtual_stages) / num_microbatches


def bubble_fraction(kind: str | PipelineSchedule, *, num_stages: int, num_microbatches: int,
                    virtual_stages: int = 1) -> Fraction:
    """Idle share of the time: (P-1)/(M+P-1); interleaved with M >= P, (P-1)/(V*M+P-1)."""
    idle = bubble_microbatches(kind, num_stages=num_stages, num_microbatches=num_microbatches,
                               virtual_stages=virtual_stages)
    return idle / (num_microbatches + idle)


# ----- what the runtime derives from a stage's position: point-to-point transfers -----

@dataclass(frozen=True)
class Message:
    """One tensor crossing between model chunks: the output of ``op`` for ``microbatch`` on model chunk
    ``source`` (an activation going to source + 1 when forward, a gradient going to source - 1 when backward)."""

    op: Op
    microbatch: int
    source: int

    def __str__(self) -> str:
        dest = self.source + 1 if self.op is Op.FORWARD else self.source - 1
        kind = "activation" if self.op is Op.FORWARD else "gradient"
        return f"{kind} of micro-batch {self.microbatch} (model chunk {self.source} -> {dest})"


@dataclass(frozen=True)
class Transfer:
    """A message this stage receives from, or sends to, ``peer`` (a stage; == own stage when local)."""

    message: Message
    peer: int


@dataclass(frozen=True)
class Transfers:
    """What an action needs before it runs and produces after it runs.

    ``recv``: the input from another model chunk (None for the first chunk's forward and the last
    chunk's backward, whose inputs are the data batch and the loss). ``send``: the output for another
    model chunk (None for the last chunk's forward and the first chunk's backward). ``*_local`` is true
    when the other chunk lives on the same stage (P = 1 with V > 1): no communication, just a hand-off.
    """

    recv: Transfer | None
    send: Transfer | None
    recv_local: bool = False
    send_local: bool = False


def stage_of_model_chunk(model_chunk: int, num_stages: int) -> tuple[int, int]:
    """(stage, local chunk) that holds ``model_chunk``."""
    return model_chunk % num_stages, model_chunk // num_stages


def transfers(action: Action, *, stage: int, num_stages: int, virtual_stages: int) -> Transfers:
    """The receive before and the send after ``action`` on ``stage``, derived from positions alone."""
    here = action.model_chunk(stage=stage, num_stages=num_stages)
    last = num_stages * virtual_stages - 1
    if action.op is Op.FORWARD:
        recv_from, send_to = (here - 1 if here > 0 else None), (here + 1 if here < last else None)
    else:
        recv_from, send_to = (here + 1 if here < last else None), (here - 1 if here > 0 else None)
    recv = send = None
    if recv_from is not None:
        recv = Transfer(Message(action.op, action.microbatch, recv_from), stage_of_model_chunk(recv_from, num_stages)[0])
    if send_to is not None:
        send = Transfer(Message(action.op, action.microbatch, here), stage_of_model_chunk(send_to, num_stages)[0])
    return Transfers(recv=recv, send=send, recv_local=recv is not None and recv.peer == stage,
                     send_local=send is not None and send.peer == stage)


def infer_sizes(schedule: Sequence[Sequence[Action]]) -> tuple[int, int, int]:
    """(P, M, V) of a schedule: stages, micro-batches and chunks per stage, from the actions in it."""
    actions = [a for stage in schedule for a in stage]
    if not schedule or not actions:
        raise PipelineError("the schedule is empty: give one non-empty action list per stage")
    return len(schedule), max(a.microbatch for a in actions) + 1, max(a.chunk for a in actions) + 1


def forward_only(schedule: Sequence[Sequence[Action]]) -> ActionTable:
    """The schedule without its backwards: an evaluation pass (`PipelineRuntime.evaluate`). Each stage keeps
    its training forward order, which the other stages' forwards can always follow (a forward never waits for
    a backward), and no activation is kept for a backward."""
    return [[a for a in actions if a.op is Op.FORWARD] for actions in schedule]


def validate_schedule(schedule: Sequence[Sequence[Action]]) -> tuple[int, int, int]:
    """Check each stage runs every (microbatch, chunk) exactly once forward and once backward, forward
    first, or, in a schedule with no backward at all (`forward_only`), exactly once forward; returns
    (P, M, V). Cross-stage order is checked by `simulate.check_schedule`."""
    num_stages, num_microbatches, virtual_stages = infer_sizes(schedule)
    expected = {(m, v) for m in range(num_microbatches) for v in range(virtual_stages)}
    ops = list(Op) if any(a.op is Op.BACKWARD for stage in schedule for a in stage) else [Op.FORWARD]
    for stage, actions in enumerate(schedule):
        seen: dict[Op, set[tuple[int, int]]] = {Op.FORWARD: set(), Op.BACKWARD: set()}
        for a in actions:
            key = (a.microbatch, a.chunk)
            if a.microbatch < 0 or a.chunk < 0:
                raise PipelineError(f"stage {stage}: action {a} has a negative index")
            if key in seen[a.op]:
                raise PipelineError(f"stage {stage}: action {a} appears twice; each runs exactly once")
            if a.op is Op.BACKWARD and key not in seen[Op.FORWARD]:
                raise PipelineError(f"stage {stage}: {a} comes before its forward "
                                    f"{Action(Op.FORWARD, a.microbatch, a.chunk)}")
            seen[a.op].add(key)
        for op in ops:
            missing = sorted(expected - seen[op])
            if missing:
                names = ", ".join(str(Action(op, m, v)) for m, v in missing[:5])
                raise PipelineError(f"stage {stage}: missing {names}{' ...' if len(missing) > 5 else ''}; every "
                                    f"stage runs each of the {num_microbatches} micro-batch(es) x "
                                    f"{virtual_stages} chunk(s) once forward and once backward")
    return num_stages, num_microbatches, virtual_stages
