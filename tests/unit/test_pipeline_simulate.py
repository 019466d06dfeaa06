"""The schedule simulator: exact bubble formulas, dependency-respecting times, measured traces, pictures."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.parallel.pipeline.schedules import (
    Action, Op, PipelineError, bubble_fraction, bubble_ratio, build_schedule, transfers)
from shardwise.parallel.pipeline.simulate import (
    ActionRecord, Costs, DeadlockError, SendMode, Timeline, measured_costs, replayed_costs, simulate)

COSTS = [(1, 1), (1, 2), (2, 3)]


def run(kind: str, p: int, m: int, v: int = 1, costs: Costs = Costs(), **kw) -> Timeline:
    return simulate(build_schedule(kind, num_stages=p, num_microbatches=m, virtual_stages=v), costs=costs, **kw)


# ----- the bubble, exactly -----

@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_exactly_the_formula(kind: str) -> None:
    for f, b in COSTS:
        for p in range(1, 7):
            for m in range(1, 13):
                t = run(kind, p, m, costs=Costs(f, b))
                assert t.makespan == (m + p - 1) * (f + b)
                assert t.bubble_fraction == Fraction(p - 1, m + p - 1)   # share of P x makespan
                assert t.bubble_ratio == Fraction(p - 1, m)              # Narayanan's t_pb / t_id
                assert t.bubble_fraction == bubble_fraction(kind, num_stages=p, num_microbatches=m)


def test_interleaved_bubble_is_the_1f1b_bubble_divided_by_v() -> None:
    # Chunk actions cost f/V and b/V (Costs are per whole stage), so the work per stage is unchanged.
    checked = 0
    for f, b in COSTS:
        for p in range(1, 6 if (f, b) == (1, 2) else 4):
            for m in range(p, 13 if (f, b) == (1, 2) else 9):
                for v in (2, 3, 4):
                    t = run("interleaved_1f1b", p, m, v, costs=Costs(f, b))
                    one_f_one_b = run("1f1b", p, m, costs=Costs(f, b))
                    assert t.bubble_ratio == one_f_one_b.bubble_ratio / v == Fraction(p - 1, v * m)
                    assert t.bubble_fraction == Fraction(p - 1, v * m + p - 1)
                    assert t.makespan == m * (f + b) + Fraction((p - 1) * (f + b), v)
                    checked += 1
    assert checked > 200


def test_interleaved_with_fewer_microbatches_than_stages_matches_its_closed_form() -> None:
    # M < P: each return to stage 0 waits P - M slots, so the bubble is not divided by V.
    for p in range(2, 7):
        for m in range(1, p):
            for v in (2, 3):
                t = run("interleaved_1f1b", p, m, v, costs=Costs(1, 2))
                sizes = dict(num_stages=p, num_microbatches=m, virtual_stages=v)
                assert t.bubble_ratio == bubble_ratio("interleaved_1f1b", **sizes)
                assert t.bubble_ratio == Fraction(p - 1 + (v - 1) * (p - m), v * m)
                assert t.bubble_fraction == bubble_fraction("interleaved_1f1b", **sizes)


def test_one_stage_has_no_bubble() -> None:
    assert run("1f1b", 1, 5).bubble_fraction == 0 and run("interleaved_1f1b", 1, 3, 2).bubble_ratio == 0


# ----- times respect dependencies, one action per stage, and nothing waits without cause -----

def _check_times(t: Timeline, latency: Fraction, num_stages: int, virtual: int) -> None:
    end = {(r.stage, r.action): r.end for r in t.records}
    where = {}
    for r in t.records:
        where[(r.action.op, r.action.microbatch, r.action.model_chunk(stage=r.stage, num_stages=num_stages))] = r
    for s in range(num_stages):
        rows = t.stage_records(s)
        for prev, cur in zip(rows, rows[1:]):
            assert cur.start >= prev.end  # one action at a time
        for i, r in enumerate(rows):
            ready = [rows[i - 1].end if i else 0]
            tr = transfers(r.action, stage=s, num_stages=num_stages, virtual_stages=virtual)
            if tr.recv is not None:
                src = where[(tr.recv.message.op, tr.recv.message.microbatch, tr.recv.message.source)]
                ready.append(src.end + (0 if tr.recv_local else latency))
            if r.action.op is Op.BACKWARD:
                ready.append(end[(s, Action(Op.FORWARD, r.action.microbatch, r.action.chunk))])
            assert r.start == max(ready)  # starts as soon as its stage and its inputs allow


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]), st.integers(1, 5), st.integers(1, 8),
       st.integers(1, 3), st.lists(st.integers(1, 5), min_size=10, max_size=10), st.integers(0, 3))
def test_async_times_follow_the_dependencies(kind: str, p: int, m: int, v: int, raw: list[int], lat: int) -> None:
    v = v if kind == "interleaved_1f1b" else 1
    costs = Costs(forward=raw[:p], backward=raw[5:5 + p], latency=Fraction(lat, 2))
    t = run(kind, p, m, v, costs=costs)
    assert len(t.records) == 2 * p * m * v
    _check_times(t, costs.latency, p, v)
    for s in range(p):
        assert t.busy(s) == m * (costs.forward[s] + costs.backward[s])


def test_latency_adds_to_every_hop() -> None:
    # P = 2, M = 1: F on stage 0, hop, F on stage 1, B on stage 1, hop, B on stage 0.
    t = run("1f1b", 2, 1, costs=Costs(forward=1, backward=2, latency=Fraction(1, 2)))
    assert t.makespan == 2 * 1 + 2 * 2 + 2 * Fraction(1, 2)
    assert [(r.start, r.end) for r in t.stage_records(1)] == [(Fraction(3, 2), Fraction(5, 2)), (Fraction(5, 2), Fraction(9, 2))]


def test_blocking_sends_never_beat_async_ones() -> None:
    for p in range(1, 5):
        for m in range(1, 6):
            costs = Costs(1, 2, latency=1)
            assert run("gpipe", p, m, costs=costs, mode=SendMode.BLOCKING).makespan >= run("gpipe", p, m, costs=costs).makespan
            assert run("1f1b", p, m, costs=costs, mode=SendMode.BATCHED).makespan >= run("1f1b", p, m, costs=costs).makespan


def test_deadlock_raises_a_user_error() -> None:
    with pytest.raises(DeadlockError, match=r"deadlock with blocking sends \(stage 0 -> stage 1 -> stage 0\)"):
        run("1f1b", 2, 3, mode="blocking")


def test_costs_are_checked() -> None:
    with pytest.raises(PipelineError, match="3 values for 2 stages"):
        run("1f1b", 2, 2, costs=Costs(forward=[1, 1, 1]))
    with pytest.raises(PipelineError, match="backward cost of stage 0 = -1"):
        run("1f1b", 2, 2, costs=Costs(backward=-1))


# ----- measured traces use the same Timeline -----

def test_measured_trace_gives_the_same_figures() -> None:
    simulated = run("interleaved_1f1b", 2, 4, 2, costs=Costs(1, 2))
    trace = [(r.stage, str(r.action), float(r.start) + 100.0, float(r.end) + 100.0) for r in simulated.records]
    measured = Timeline.from_records(trace, name="measured")
    assert (measured.num_stages, measured.num_microbatches, measured.virtual_stages) == (2, 4, 2)
    assert measured.makespan == pytest.approx(float(simulated.makespan))
    assert measured.bubble_fraction == pytest.approx(float(simulated.bubble_fraction))
    assert [measured.peak_in_flight(s) for s in range(2)] == [simulated.peak_in_flight(s) for s in range(2)]
    assert measured.order(0) == simulated.order(0)


def test_measured_trace_peak_in_flight_and_bad_records() -> None:
    f, b = Op.FORWARD, Op.BACKWARD
    t = Timeline.from_records([ActionRecord(0, Action(f, 0), 0.0, 1.0), (0, "F1", 1.0, 2.0), (0, "B0", 2.5, 4.0),
                               (0, "B1", 4.0, 5.0), (1, Action(f, 0), 1.0, 2.0), (1, Action(b, 0), 2.0, 2.5)])
    assert t.peak_in_flight(0) == 2 and t.peak_in_flight(1) == 1
    assert t.idle(0) == pytest.approx(0.5) and t.idle(1) == pytest.approx(3.5)
    with pytest.raises(PipelineError, match="ends .* before it starts"):
        Timeline.from_records([(0, "F0", 2.0, 1.0)])
    with pytest.raises(PipelineError, match="cannot read action"):
        Timeline.from_records([(0, "forward0", 0.0, 1.0)])


# ----- pictures -----

def test_timeline_picture_has_labelled_boxes_and_a_title(tmp_path) -> None:
    from shardwise.parallel.pipeline.timeline import draw_timeline

    t = run("interleaved_1f1b", 2, 4, 2, costs=Costs(1, 2), name="interleaved_1f1b")
    path = tmp_path / "timeline.png"
    fig = draw_timeline(t, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    ax = fig.axes[0]
    labels = {text.get_text() for text in ax.texts}
    assert {"F0", "B3", "F3.1", "B0.1"} <= labels
    assert "P=2, M=4, V=2" in ax.get_title(loc="left") and "bubble" in ax.get_title(loc="left")
    assert [tick.get_text() for tick in ax.get_yticklabels()] == ["stage 0", "stage 1"]


def test_per_chunk_costs_and_measured_costs_round_trip() -> None:
    # A trace simulated with unequal per-chunk costs: the means read back from it are those costs, and
    # simulating under them gives the very same timeline (the yardstick the benchmark compares with).
    costs = Costs(forward=[[1, 3], [2, 2]], backward=[[2, 6], [4, 5]])
    schedule = build_schedule("interleaved_1f1b", num_stages=2, num_microbatches=4, virtual_stages=2)
    trace = simulate(schedule, costs=costs)
    assert {(r.stage, str(r.action)): r.end - r.start for r in trace.records}[(0, "B2.1")] == 6
    back = measured_costs(Timeline.from_records(trace.records, num_stages=2))
    assert back.forward == [[1, 3], [2, 2]] and back.backward == [[2, 6], [4, 5]]
    again = simulate(schedule, costs=back)
    assert again.records == trace.records and again.bubble_fraction == trace.bubble_fraction
    equal = simulate(schedule, costs=Costs(forward=[[1, 1], [1, 1]], backward=[[2, 2], [2, 2]]))
    assert equal.bubble_fraction == bubble_fraction("interleaved_1f1b", num_stages=2, num_microbatches=4,
                                                    virtual_stages=2)


def test_per_chunk_costs_are_checked() -> None:
    with pytest.raises(PipelineError, match="1 values for 2 chunk"):
        run("interleaved_1f1b", 2, 2, 2, costs=Costs(forward=[[1], [1]]))
    with pytest.raises(PipelineError, match="chunk 1 = -1"):
        run("interleaved_1f1b", 2, 2, 2, costs=Costs(forward=[[1, -1], [1, 1]]))


def test_a_replayed_trace_without_waits_is_its_own_simulation() -> None:
    # Irregular per-action times (as on a shared machine): the mean costs do not reproduce the trace, the replay
    # of each action's own time does; a trace with an extra wait has a larger bubble than its replay.
    schedule = build_schedule("1f1b", num_stages=2, num_microbatches=4)
    odd = {(0, Action(Op.FORWARD, 1)): 3, (1, Action(Op.BACKWARD, 2)): 5}
    trace = simulate(schedule, costs=Costs(1, 2, actions=odd))
    assert {(r.stage, r.action): r.end - r.start for r in trace.records}[(0, Action(Op.FORWARD, 1))] == 3
    replay = simulate(schedule, costs=replayed_costs(Timeline.from_records(trace.records, num_stages=2)))
    assert replay.records == trace.records
    means = simulate(schedule, costs=measured_costs(Timeline.from_records(trace.records, num_stages=2)))
    assert means.bubble_fraction != trace.bubble_fraction
    last = Action(Op.BACKWARD, 3)   # stage 0's last action starts 1 later: a wait the replay does not have
    waited = [ActionRecord(r.stage, r.action, r.start + 1, r.end + 1) if (r.stage, r.action) == (0, last) else r
              for r in trace.records]
    measured = Timeline.from_records(waited, num_stages=2)
    assert measured.bubble_fraction > simulate(schedule, costs=replayed_costs(measured)).bubble_fraction
