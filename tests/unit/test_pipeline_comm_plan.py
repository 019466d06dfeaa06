"""The p2p programs: a lockstep grid of batches that is safe under NCCL's rules (matching by order, no tags,
every batch a rendezvous), checked for every schedule of small sizes; and the checker catches broken orders."""

from __future__ import annotations

from collections import defaultdict

import pytest

from shardwise.parallel.pipeline import PipelineError, build_schedule, transfers
from shardwise.parallel.pipeline.comm_plan import Batch, Compute, build_programs, check_programs, format_program

CASES = [(kind, p, m, v) for kind in ("gpipe", "1f1b", "interleaved_1f1b") for p in range(1, 6) for m in range(1, 10)
         for v in ((1, 2, 3) if kind == "interleaved_1f1b" else (1,))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-P{c[1]}-M{c[2]}-V{c[3]}")
def test_every_program_is_safe_under_nccl_rules(case: tuple[str, int, int, int]) -> None:
    kind, p, m, v = case
    schedule = build_schedule(kind, num_stages=p, num_microbatches=m, virtual_stages=v)
    programs = build_programs(schedule)
    check_programs(schedule, programs)
    for stage, steps in enumerate(programs):
        batches = [s for s in steps if isinstance(s, Batch)]
        assert [b.tick for b in batches] == sorted({b.tick for b in batches}), "one batch per tick, in tick order"
        for b in batches:
            assert len(b.sends) <= 1 and len({r.peer for r in b.recvs}) == len(b.recvs)
        # every message the stage's actions send to another stage is in exactly one batch
        sent = [t.send for a in schedule[stage] for t in [transfers(a, stage=stage, num_stages=p, virtual_stages=v)]
                if t.send is not None and not t.send_local]
        assert sorted(map(str, sent)) == sorted(str(s) for b in batches for s in b.sends)


def test_golden_1f1b_p2_m3() -> None:
    # ticks of the unit-cost grid: stage 1 runs F0 at 1, B0 at 2, F1 at 3, B1 at 4, F2 at 5, B2 at 6
    schedule = build_schedule("1f1b", num_stages=2, num_microbatches=3)
    assert [format_program(steps) for steps in build_programs(schedule)] == [
        "F0 [1: send F0@0->1] F1 [2: send F1@0->1] [3: recv B0@1<-1] B0 F2 [5: send F2@0->1, recv B1@1<-1] B1 "
        "[7: recv B2@1<-1] B2",
        "[1: recv F0@0<-0] F0 [2: recv F1@0<-0] B0 [3: send B0@1->0] F1 B1 [5: send B1@1->0, recv F2@0<-0] F2 B2 "
        "[7: send B2@1->0]",
    ]


def _posting_orders(schedule, p: int, v: int) -> tuple[dict, dict]:
    """Per (sender, receiver): the messages in the sender's action order and in the receiver's."""
    sends: dict = defaultdict(list)
    recvs: dict = defaultdict(list)
    for stage, actions in enumerate(schedule):
        for a in actions:
            t = transfers(a, stage=stage, num_stages=p, virtual_stages=v)
            if t.send is not None and not t.send_local:
                sends[(stage, t.send.peer)].append(t.send.message)
            if t.recv is not None and not t.recv_local:
                recvs[(t.recv.peer, stage)].append(t.recv.message)
    return sends, recvs


def test_action_order_alone_would_mismatch_messages_without_tags() -> None:
    # Interleaved at P = 2 with uneven groups (M = 5): stage 1 sends in an order stage 0 does not receive in,
    # which is why the programs post by grid tick, not by each stage's own action order.
    sends, recvs = _posting_orders(build_schedule("interleaved_1f1b", num_stages=2, num_microbatches=5,
                                                  virtual_stages=2), 2, 2)
    assert any(sends[k] != recvs[k] for k in sends)
    schedule = build_schedule("interleaved_1f1b", num_stages=2, num_microbatches=5, virtual_stages=2)
    check_programs(schedule, build_programs(schedule))


def test_checker_catches_receives_posted_out_of_order() -> None:
    schedule = build_schedule("interleaved_1f1b", num_stages=2, num_microbatches=5, virtual_stages=2)
    programs = build_programs(schedule)
    steps = list(programs[1])
    # swap the receives of stage 1's first two batches that receive: it would take F1 for F0 (no tags in NCCL)
    at = [i for i, s in enumerate(steps) if isinstance(s, Batch) and s.recvs][:2]
    a, b = steps[at[0]], steps[at[1]]
    steps[at[0]], steps[at[1]] = Batch(a.tick, a.sends, b.recvs), Batch(b.tick, b.sends, a.recvs)
    with pytest.raises(PipelineError, match="NCCL matches by order"):
        check_programs(schedule, [programs[0], steps])


def test_checker_catches_a_send_before_its_compute() -> None:
    schedule = build_schedule("1f1b", num_stages=2, num_microbatches=2)
    programs = build_programs(schedule)
    early = [programs[0][1], programs[0][0], *programs[0][2:]]   # [1: send F0] before F0
    with pytest.raises(PipelineError, match="before computing it"):
        check_programs(schedule, [early, programs[1]])


def test_checker_catches_a_receive_posted_too_late() -> None:
    schedule = build_schedule("1f1b", num_stages=2, num_microbatches=2)
    programs = build_programs(schedule)
    late = [s for s in programs[1] if not (isinstance(s, Batch) and s.tick == 1)]   # drops the recv of F0
    with pytest.raises(PipelineError, match="before receiving its input"):
        check_programs(schedule, [programs[0], late])


def test_checker_catches_an_unbatched_1f1b_exchange() -> None:
    # send and receive of one tick split into two batches, send first on both stages: the classic hang
    schedule = build_schedule("1f1b", num_stages=2, num_microbatches=4)
    programs = build_programs(schedule)
    split = []
    for steps in programs:
        out = []
        for s in steps:
            if isinstance(s, Batch) and s.sends and s.recvs:
                out += [Batch(s.tick, s.sends, ()), Batch(s.tick, (), s.recvs)]
            else:
                out.append(s)
        split.append(out)
    with pytest.raises(PipelineError, match="deadlock"):
        check_programs(schedule, split)


def test_checker_wants_the_schedule_order() -> None:
    schedule = build_schedule("gpipe", num_stages=1, num_microbatches=2)
    programs = build_programs(schedule)
    assert all(isinstance(s, Compute) for s in programs[0])
    with pytest.raises(PipelineError, match="not the schedule's"):
        check_programs(schedule, [programs[0][::-1]])
