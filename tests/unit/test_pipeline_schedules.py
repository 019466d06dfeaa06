"""Pipeline schedules as data: golden lists, invariants for all small P, M, V, peer oracle, errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.errors import UserError
from shardwise.parallel.pipeline.schedules import (
    Action, Message, Op, PipelineError, build_schedule, format_actions, gpipe, interleaved_groups,
    interleaved_one_f_one_b, interleaved_warmup, one_f_one_b, transfers, validate_schedule)
from shardwise.parallel.pipeline.simulate import Deadlock, SendMode, Timeline, check_schedule

KINDS = ["gpipe", "1f1b", "interleaved_1f1b"]


def lines(kind: str, p: int, m: int, v: int = 1) -> list[str]:
    return [format_actions(a) for a in build_schedule(kind, num_stages=p, num_microbatches=m, virtual_stages=v)]


# ----- golden lists -----

def test_style_golden_string_for_1f1b_stage_0_of_4() -> None:
    # Warm-up is P - s - 1 = 3 forwards; the steady state then starts with F3, so B0 follows 4 forwards.
    assert format_actions(one_f_one_b(num_stages=4, stage=0, num_microbatches=8)) == \
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"


def test_golden_1f1b_p4_m8_all_stages() -> None:
    assert lines("1f1b", 4, 8) == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    ]


def test_golden_1f1b_fewer_microbatches_than_stages() -> None:
    # Warm-up min(P - s - 1, M): stages 0-2 of 4 run both forwards first, only the last alternates.
    assert lines("1f1b", 4, 2) == ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]


def test_golden_gpipe() -> None:
    assert lines("gpipe", 2, 3) == ["F0 F1 F2 B0 B1 B2"] * 2


def test_golden_interleaved_p2_m4_v2() -> None:
    # Groups of P = 2 micro-batches go through chunk 0 then chunk 1; warm-up 2(P-s-1) + (V-1)P.
    assert lines("interleaved_1f1b", 2, 4, 2) == [
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3",
    ]


def test_golden_interleaved_p4_m8_v2_first_and_last_stage() -> None:
    got = lines("interleaved_1f1b", 4, 8, 2)
    assert got[0] == ("F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 F4 F5 F6 B0.1 F7 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B0 "
                      "F7.1 B1 B2 B3 B4.1 B5.1 B6.1 B7.1 B4 B5 B6 B7")
    assert got[3] == ("F0 F1 F2 F3 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4 B0 F5 B1 F6 B2 F7 B3 "
                      "F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 B4 B5 B6 B7")


def test_golden_interleaved_p2_m3_v3_uneven_groups() -> None:
    # M = 3 is not a multiple of P = 2: one group of 3 (Megatron refuses this M; we allow it).
    assert interleaved_groups(num_stages=2, num_microbatches=3) == [3]
    assert lines("interleaved_1f1b", 2, 3, 3)[1] == \
        "F0 F1 F2 F0.1 F1.1 F2.1 F0.2 B0.2 F1.2 B1.2 F2.2 B2.2 B0.1 B1.1 B2.1 B0 B1 B2"


def test_interleaved_groups_spread_the_remainder() -> None:
    assert interleaved_groups(num_stages=4, num_microbatches=8) == [4, 4]
    assert interleaved_groups(num_stages=4, num_microbatches=13) == [5, 4, 4]
    assert interleaved_groups(num_stages=4, num_microbatches=3) == [3]


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for p, m in [(1, 1), (2, 5), (4, 8), (3, 2)]:
        assert lines("interleaved_1f1b", p, m, 1) == lines("1f1b", p, m)


def test_action_text_round_trip() -> None:
    for a in [Action(Op.FORWARD, 0), Action(Op.BACKWARD, 12, 3), Action(Op.FORWARD, 7, 1)]:
        assert Action.parse(str(a)) == a
    assert str(Action(Op.BACKWARD, 3, 1)) == "B3.1" and str(Action(Op.FORWARD, 3)) == "F3"
    with pytest.raises(PipelineError, match="F<microbatch>"):
        Action.parse("X3")


# ----- the peer: torch.distributed.pipelining's interleaved order -----

def _torch_interleaved(p: int, m: int, v: int) -> list[str] | None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "_get_1f1b_rank_ops") or not hasattr(schedules, "_get_warmup_ops"):
        pytest.skip("this torch has no _get_1f1b_rank_ops/_get_warmup_ops")
    rounds = max(1, m // p)
    if m % rounds:
        return None  # torch refuses this M
    per_round = m // rounds
    out = []
    for rank in range(p):
        warmup = schedules._get_warmup_ops(rank, v, per_round, p, m, multiply_factor=2)
        fwd_bwd = m * v - warmup
        ops = schedules._get_1f1b_rank_ops(
            v, p, warmup, fwd_bwd, warmup, rank,
            lambda step: ((step // per_round) % v) * p + rank,
            lambda step: (v - 1 - ((step - warmup) // per_round) % v) * p + rank)
        text = []
        for op in filter(None, ops):
            kind = "F" if op.computation_type == schedules._ComputationType.FORWARD else "B"
            text.append(str(Action(Op(kind), op.microbatch_index, op.stage_index // p)))
        out.append(" ".join(text))
    return out


def test_interleaved_matches_torch_pipelining_wherever_torch_accepts_m() -> None:
    compared = 0
    for p in range(1, 5):
        for m in range(1, 10):
            for v in (2, 3):
                expected = _torch_interleaved(p, m, v)
                if expected is not None:
                    assert lines("interleaved_1f1b", p, m, v) == expected, (p, m, v)
                    compared += 1
    assert compared > 50


# ----- invariants for all small P, M, V -----

sizes = st.tuples(st.sampled_from(KINDS), st.integers(1, 6), st.integers(1, 12), st.integers(1, 4))


@settings(max_examples=120, deadline=None)
@given(sizes)
def test_every_schedule_is_complete_ordered_and_runs_without_deadlock(case: tuple[str, int, int, int]) -> None:
    kind, p, m, v = case
    v = v if kind == "interleaved_1f1b" else 1
    schedule = build_schedule(kind, num_stages=p, num_microbatches=m, virtual_stages=v)
    assert validate_schedule(schedule) == (p, m, v)  # one F and one B per (microbatch, chunk), F first
    for stage in schedule:
        assert len(stage) == 2 * m * v
    timeline = check_schedule(schedule, mode=SendMode.ASYNC)
    assert isinstance(timeline, Timeline), timeline.explain()
    for s in range(p):
        peak = timeline.peak_in_flight(s)
        if kind == "gpipe":
            assert peak == m
        elif kind == "1f1b" or v == 1:
            assert peak == min(p - s, m)  # 1F1B: at most P - s micro-batches of activations
        else:
            warm = interleaved_warmup(num_stages=p, stage=s, num_microbatches=m, virtual_stages=v)
            assert peak == min(warm + 1, m * v)
            if m % p == 0:  # Megatron's bound, in chunk activations (each 1/V of the stage)
                assert peak <= min(2 * (p - s - 1) + (v - 1) * p + 1, m * v)


def test_gpipe_runs_under_every_send_mode() -> None:
    for p in range(1, 5):
        for m in range(1, 7):
            for mode in SendMode:
                assert isinstance(check_schedule(build_schedule("gpipe", num_stages=p, num_microbatches=m),
                                                 mode=mode), Timeline)


def test_1f1b_needs_async_or_batched_sends() -> None:
    for p in range(2, 5):
        for m in range(2, 7):
            schedule = build_schedule("1f1b", num_stages=p, num_microbatches=m)
            assert isinstance(check_schedule(schedule, mode=SendMode.ASYNC), Timeline)
            assert isinstance(check_schedule(schedule, mode=SendMode.BATCHED), Timeline)
            assert isinstance(check_schedule(schedule, mode=SendMode.BLOCKING), Deadlock)
    # With one micro-batch there is nothing to cross.
    assert isinstance(check_schedule(build_schedule("1f1b", num_stages=4, num_microbatches=1),
                                     mode=SendMode.BLOCKING), Timeline)


def test_blocking_1f1b_deadlock_is_explained() -> None:
    result = check_schedule(build_schedule("1f1b", num_stages=2, num_microbatches=2), mode=SendMode.BLOCKING)
    assert isinstance(result, Deadlock) and result.cycle == (0, 1)
    text = result.explain()
    assert "stage 0 (after F1) waits to send the activation of micro-batch 1" in text
    assert "stage 1 (after B0) waits to send the gradient of micro-batch 0" in text
    assert "isend" in text


def test_interleaved_batched_sends_can_deadlock() -> None:
    # Pairing each send with the next receive is not enough once chunks interleave (Megatron batches
    # both directions of a forward/backward pair); the runtime must post sends asynchronously.
    schedule = build_schedule("interleaved_1f1b", num_stages=2, num_microbatches=4, virtual_stages=2)
    assert isinstance(check_schedule(schedule, mode=SendMode.BATCHED), Deadlock)
    assert isinstance(check_schedule(schedule, mode=SendMode.ASYNC), Timeline)


def test_a_bad_order_deadlocks_even_with_async_sends() -> None:
    f, b = Op.FORWARD, Op.BACKWARD
    schedule = [[Action(f, 0), Action(b, 0), Action(f, 1), Action(b, 1)],
                [Action(f, 1), Action(f, 0), Action(b, 0), Action(b, 1)]]
    result = check_schedule(schedule, mode=SendMode.ASYNC)
    assert isinstance(result, Deadlock) and set(result.cycle) == {0, 1}
    assert "before F1" in result.explain() and "reorder" in result.explain()


def test_same_stage_chunk_order_is_checked() -> None:
    # P = 1, V = 2: chunk 1 needs chunk 0's output from the same stage.
    f, b = Op.FORWARD, Op.BACKWARD
    schedule = [[Action(f, 0, 1), Action(f, 0, 0), Action(b, 0, 1), Action(b, 0, 0)]]
    result = check_schedule(schedule)
    assert isinstance(result, Deadlock) and result.cycle == (0,)
    assert "runs F0.1 before the same stage produces its input" in result.explain()


# ----- transfers derived from position -----

def test_transfers_follow_the_model_chunk_order() -> None:
    f, b = Op.FORWARD, Op.BACKWARD
    first = transfers(Action(f, 2), stage=0, num_stages=4, virtual_stages=1)
    assert first.recv is None and first.send.peer == 1 and first.send.message == Message(f, 2, 0)
    last = transfers(Action(f, 2), stage=3, num_stages=4, virtual_stages=1)
    assert last.send is None and last.recv.peer == 2
    back = transfers(Action(b, 2), stage=3, num_stages=4, virtual_stages=1)
    assert back.recv is None and back.send.peer == 2 and back.send.message == Message(b, 2, 3)
    # Interleaved: stage 3's chunk 0 (model chunk 3) feeds stage 0's chunk 1 (model chunk 4).
    wrap = transfers(Action(f, 0, 0), stage=3, num_stages=4, virtual_stages=2)
    assert wrap.send.peer == 0 and not wrap.send_local
    # P = 1: the hand-off between chunks stays on the stage.
    local = transfers(Action(f, 0, 0), stage=0, num_stages=1, virtual_stages=2)
    assert local.send_local and local.send.peer == 0


# ----- errors -----

@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="1f1b", num_stages=2, num_microbatches=0), "micro-batches = 0"),
    (dict(kind="1f1b", num_stages=0, num_microbatches=2), "pipeline stages = 0"),
    (dict(kind="1f1b", num_stages=2, num_microbatches=4, virtual_stages=2), "needs schedule 'interleaved_1f1b'"),
    (dict(kind="interleaved_1f1b", num_stages=2, num_microbatches=4, virtual_stages=0), "virtual_stages = 0"),
    (dict(kind="1f1b_interleaved", num_stages=2, num_microbatches=4), "did you mean 'interleaved_1f1b'"),
    (dict(kind="gpip", num_stages=2, num_microbatches=4), "did you mean 'gpipe'"),
])
def test_clear_errors(kwargs: dict, match: str) -> None:
    kind = kwargs.pop("kind")
    with pytest.raises(PipelineError, match=match) as info:
        build_schedule(kind, **kwargs)
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)


def test_stage_out_of_range() -> None:
    with pytest.raises(PipelineError, match="stage = 4 is outside 0..3"):
        gpipe(num_stages=4, stage=4, num_microbatches=2)
    with pytest.raises(PipelineError, match="outside"):
        interleaved_one_f_one_b(num_stages=2, stage=-1, num_microbatches=2, virtual_stages=2)


def test_validation_names_the_broken_action() -> None:
    f, b = Op.FORWARD, Op.BACKWARD
    with pytest.raises(PipelineError, match="stage 0: B0 comes before its forward F0"):
        validate_schedule([[Action(b, 0), Action(f, 0)]])
    with pytest.raises(PipelineError, match="stage 1: missing B1"):
        validate_schedule([[Action(f, 0), Action(f, 1), Action(b, 0), Action(b, 1)],
                           [Action(f, 0), Action(f, 1), Action(b, 0)]])
    with pytest.raises(PipelineError, match="appears twice"):
        validate_schedule([[Action(f, 0), Action(f, 0), Action(b, 0)]])
