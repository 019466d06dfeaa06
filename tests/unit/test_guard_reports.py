"""The pure parts of the hang and desync guards: the ledger's sequence numbers and fingerprint, the verdict and
desync lines, the timeouts, the skip limit and the CLI's --timeout."""

from __future__ import annotations

import argparse
import json
import threading

import pytest

from shardwise.cli import train as train_cli
from shardwise.comm.ledger import CommLedger
from shardwise.comm.sequence import END, TRAIN_STEP, describe_desync
from shardwise.comm.watchdog import backend_timeout_s, cadence, verdict
from shardwise.config import load_config
from shardwise.errors import UserError
from shardwise.engine.skips import consecutive_limit, skips_nonfinite_steps


def _run(ledger: CommLedger, ops: list[tuple[str, str, str]]) -> None:
    for op, group, sig in ops:
        token = ledger.start(op, group, sig)
        ledger.finish(token, op=op, group=group, group_size=2, nbytes=4, dtype="float32")


def test_fingerprint_follows_each_group_order_but_not_the_interleaving_of_groups() -> None:
    dp = [("all_reduce", "dp", "float32[8]"), ("all_reduce", "dp", "float32[4]")]
    tp = [("all_reduce", "tp", "float32[2, 3]")]
    a, b, c, d = CommLedger(), CommLedger(), CommLedger(), CommLedger()
    _run(a, dp + tp)
    _run(b, [dp[0], tp[0], dp[1]])                       # another thread interleaving: the same
    _run(c, [dp[1], dp[0]] + tp)                         # another order within "dp": different
    _run(d, dp + [("all_gather", "tp", "float32[2, 3]")])
    assert a.fingerprint() == b.fingerprint()
    assert len({a.fingerprint(), c.fingerprint(), d.fingerprint()}) == 3
    assert 0 <= a.fingerprint() < 2 ** 62
    assert a.seq == {"dp": 2, "tp": 1} and a.last_done is not None and a.last_done.op == "all_reduce"
    assert a.take_sequence() == {"dp": ["all_reduce float32[8]", "all_reduce float32[4]"],
                                 "tp": ["all_reduce float32[2, 3]"]}
    assert a.take_sequence() == {}


def test_waiting_lists_operations_in_flight_with_their_sequence_number() -> None:
    ledger = CommLedger()
    _run(ledger, [("broadcast", "dp", "float32[1]")])
    ledger.begin_step(3)
    token = ledger.start("all_reduce", "dp", "float32[1]")
    (w,) = ledger.waiting()
    assert (w.op, w.group, w.seq, w.step) == ("all_reduce", "dp", 2, 3)
    ledger.finish(token, op="all_reduce", group="dp", group_size=2, nbytes=4, dtype="float32")
    assert ledger.waiting() == [] and ledger.pending() == []
    # Thread-safe: the fingerprint is the same whichever thread launched the operations of a group.
    other = CommLedger()
    t = threading.Thread(target=_run, args=(other, [("broadcast", "dp", "float32[1]"),
                                                    ("all_reduce", "dp", "float32[1]")]))
    t.start()
    t.join()
    assert other.fingerprint() == ledger.fingerprint()


def test_the_verdict_names_who_did_not_arrive_and_what_the_others_wait_on() -> None:
    reports = {0: {"step": 5, "op": "all_reduce", "group": "dp", "seq": 40, "age": 61.0},
               1: {"step": 5, "last": {"op": "all_gather", "group": "dp", "seq": 39}},
               2: None,
               3: {"step": 5, "op": "all_reduce", "group": "dp", "seq": 40, "age": 60.5}}
    line = verdict(reports, 60.0)
    assert "\n" not in line
    # the stalled ranks first, then what the others waited in for them and how long
    assert line.startswith('rank(s) 1, 2 stalled: rank(s) 0, 3 waited 61 s for them in all_reduce on "dp" #40 '
                           "(collective timeout at step 5 after 60 s (communication.timeout_minutes)); "), line
    assert line.endswith("rank(s) 1, 2 did not arrive (rank 1: step 5, outside any collective, last completed "
                         'all_gather on "dp" #39; rank 2: no report (process gone or frozen))'), line
    # every rank waits in one collective that does not complete: no rank stalled, the collective is named
    waiting = {r: {"step": 5, "op": "all_reduce", "group": "dp", "seq": 40, "age": 60.5} for r in (0, 1)}
    assert verdict(waiting, 60.0) == ('collective timeout at step 5 after 60 s (communication.timeout_minutes): '
                                      'rank(s) 0, 1 wait in all_reduce on "dp" #40')


def test_timeouts_leave_the_backend_time_for_the_report() -> None:
    for minutes in (0.05, 1, 5, 30):
        t = minutes * 60
        tick, poll, grace = cadence(t)
        assert 0 < tick <= poll <= 5.0 and grace > poll
        assert backend_timeout_s(t) > t + grace


def test_desync_lines_name_the_steps_or_the_first_differing_operation() -> None:
    steps = describe_desync({0: {"kind": TRAIN_STEP, "step": 4, "stage": 0, "fp": 1, "ops": {}},
                             1: {"kind": TRAIN_STEP, "step": 3, "stage": 0, "fp": 1, "ops": {}},
                             2: {"kind": END, "step": 4, "stage": 0, "fp": 1, "ops": {}}}, 3)
    assert steps.startswith("desync: the ranks are at different steps: rank(s) 0 start step 4; rank(s) 1 start "
                            "step 3; rank(s) 2 ended training after step 4 (engine.destroy); every rank must run")
    ops = {"dp": ["all_reduce float32[8]", "all_reduce float32[4]"]}
    other = {"dp": ["all_reduce float32[8]", "all_gather float32[4]"]}
    line = describe_desync({0: {"kind": 0, "step": 2, "stage": 0, "fp": 1, "ops": ops},
                            1: {"kind": 0, "step": 2, "stage": 0, "fp": 2, "ops": other},
                            2: {"kind": 0, "step": 2, "stage": 1, "fp": 9, "ops": {"pp": ["send float32[1]"]}}}, 3)
    assert line.startswith('desync at step 2: operation 2 on "dp" since the last check differs: rank(s) 0 ran '
                           'all_reduce float32[4]; rank(s) 1 ran all_gather float32[4]'), line


def test_skip_limits_and_defaults() -> None:
    base = {"train_batch_size": 2}
    cfg = load_config(base, dp_size=1)
    assert skips_nonfinite_steps(cfg) and consecutive_limit(cfg) == 10
    assert cfg.communication.timeout_minutes == 5.0 and cfg.communication.desync_check
    assert not skips_nonfinite_steps(load_config({**base, "nonfinite": {"skip_step": False}}, dp_size=1))
    fp16 = load_config({**base, "fp16": {"enabled": True}}, dp_size=1)
    assert consecutive_limit(fp16) == 10 + 2 * 16          # the loss-scale search is not divergence
    assert consecutive_limit(load_config({**base, "nonfinite": {"max_consecutive_skips": 0}}, dp_size=1)) == 0
    bf16_unchecked = load_config({**base, "bf16": {"enabled": True, "check_grad_overflow": False}}, dp_size=1)
    assert not skips_nonfinite_steps(bf16_unchecked)


def _train_args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", "--out", str(tmp_path / "run"), "--steps", "2", *extra])


def test_cli_timeout_goes_into_the_ranks_config(tmp_path) -> None:
    args = _train_args(tmp_path, "--timeout", "0.5")
    worker, path = train_cli.prepare(args)
    assert worker.config["communication"]["timeout_minutes"] == 0.5
    assert json.loads(path.read_text())["config"]["communication"]["timeout_minutes"] == 0.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(UserError, match="--timeout"):
            train_cli.prepare(_train_args(tmp_path, "--timeout", bad))


def test_the_backward_seed_turns_an_inf_loss_with_finite_gradients_into_a_skipped_step() -> None:
    import torch

    from shardwise.engine.skips import SkipGuard
    cfg = load_config({"train_batch_size": 2}, dp_size=1)

    def grads(seeded: bool, logits: list[float]) -> torch.Tensor:
        w = torch.nn.Parameter(torch.tensor(logits))
        loss = torch.nn.functional.cross_entropy((w * 1.0)[None], torch.tensor([0]))
        seed = SkipGuard(cfg, global_rank=0).seed(loss, loss) if seeded else None
        loss.backward(seed)
        return w.grad
    # the label's logit is -inf: the loss is inf, torch's gradients are finite (softmax - one-hot)
    assert torch.isfinite(grads(False, [float("-inf"), 0.0, 1.0])).all()
    assert torch.isnan(grads(True, [float("-inf"), 0.0, 1.0])).all()
    # a finite loss: the seed is exactly torch's own, the gradients bitwise equal
    assert torch.equal(grads(True, [0.5, 0.0, 1.0]), grads(False, [0.5, 0.0, 1.0]))
    off = load_config({"train_batch_size": 2, "nonfinite": {"skip_step": False}}, dp_size=1)
    assert SkipGuard(off, global_rank=0).seed(torch.tensor(1.0), torch.tensor(1.0)) is None


def _report(*, step: int, launched: int, intervals: dict, since: dict, op: str | None = None, group: str = "",
            seq: int = 0, signature: str = "", counts: dict | None = None) -> dict:
    rep = {"step": step, "counts": counts or {},
           "seq_state": {"stage": 0, "launched": launched, "intervals": intervals, "since": since}}
    if op:
        rep.update(op=op, group=group, seq=seq, signature=signature, age=5.0)
    return rep


def test_hang_reports_that_show_a_desync_become_its_line_and_a_stall_stays_a_timeout() -> None:
    from shardwise.comm.sequence import desync_in_reports
    check = "all_reduce int64[9]"
    common = {"dp": ["all_reduce float32[161]"], "world:check": [check]}
    # the same place in "dp" since the last agreed check holds different operations: named, whatever the waits
    shapes = {0: _report(step=2, launched=3, intervals={"3": common}, since={"dp": ["all_reduce float32[161]"]},
                         op="all_reduce", group="dp", seq=5, signature="float32[161]"),
              1: _report(step=2, launched=3, intervals={"3": common}, since={"dp": ["all_reduce float32[3]"]},
                         op="all_reduce", group="dp", seq=5, signature="float32[3]")}
    line = desync_in_reports(shapes)
    assert line is not None and line.startswith('desync at step 2: operation 2 on "dp" since the last check '
                                                'differs: rank(s) 0 ran all_reduce float32[161]; rank(s) 1 ran '
                                                'all_reduce float32[3]'), line
    # one check apart: rank 0 launched check 4 and waits in it, rank 1 waits in an extra "dp" collective
    apart = {0: _report(step=3, launched=4, intervals={"3": common, "4": common}, since={"world:check": [check]},
                        op="all_reduce", group="world:check", seq=4, signature="int64[9]",
                        counts={"dp": 2, "world:check": 4}),
             1: _report(step=2, launched=3, intervals={"3": common},
                        since={"dp": ["all_reduce float32[161]", "all_reduce float32[3]"]},
                        op="all_reduce", group="dp", seq=3, signature="float32[3]", counts={"dp": 3, "world:check": 3})}
    line = desync_in_reports(apart)
    assert line is not None and "the ranks wait in collectives that cannot pair" in line, line
    assert 'rank(s) 0 wait in all_reduce int64[9] on "world:check" #4, which rank(s) 1 did not launch' in line
    assert 'rank(s) 1 wait in all_reduce float32[3] on "dp" #3, which rank(s) 0 did not launch' in line
    # a rank outside any collective (a stall), an absent rank, or everyone in the same collective: no desync
    stalled = dict(apart)
    stalled[1] = _report(step=2, launched=3, intervals={"3": common}, since={"dp": ["all_reduce float32[161]"]})
    assert desync_in_reports(stalled) is None
    assert desync_in_reports({0: apart[0], 1: None}) is None
    same = {r: _report(step=2, launched=3, intervals={"3": common}, since={}, op="all_reduce", group="dp", seq=3,
                       signature="float32[161]") for r in (0, 1)}
    assert desync_in_reports(same) is None
    # a rank aborting on gloo's size check in a collective no ledger recorded, while the other waits in one
    aborted = {0: same[0], 1: dict(stalled[1], aborted="N4gloo14EnforceNotMetE")}
    line = desync_in_reports(aborted)
    assert line is not None and line.startswith(
        "desync at step 2: rank(s) 1 failed gloo's message-size check in a collective shardwise did not launch "
        '(torch.distributed called directly?); rank 0 waits in all_reduce float32[161] on "dp" #3'), line
    assert desync_in_reports({0: same[0], 1: dict(stalled[1], aborted="St9bad_alloc")}) is None
    # and the watchdog's verdict is that line
    assert verdict(apart, 3.0) == desync_in_reports(apart)
    assert verdict(stalled, 3.0).startswith("rank(s) 1 stalled: ") and "(collective timeout at " in verdict(stalled, 3.0)
