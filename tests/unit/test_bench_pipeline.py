"""The pipeline benchmark: its arithmetic, its argument errors, and one tiny real run on 2 ranks through
torch's elastic launcher (the path `shardwise bench pipeline --nproc 2` takes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import pipeline as bench
from shardwise.config import PipelineSchedule


def test_row_uses_medians_and_shardwise_over_torch_ratio() -> None:
    bubbles = [bench.Bubble(0.3, 0.2, 0.25, [0.01, 0.02]), bench.Bubble(0.1, 0.05, 0.05, [0.03, 0.02]),
               bench.Bubble(0.2, 0.1, 0.15, [0.02, 0.04])]
    row = bench.make_row(PipelineSchedule.ONE_F_ONE_B, 1, sw_s=[0.004, 0.001, 0.002], torch_s=[0.004, 0.004, 0.9],
                         bubbles=bubbles, formula=0.25, torch_bubbles=[0.5, 0.4, 0.6], loss_diff=0.0, grad_diff=1e-7)
    assert row.shardwise_ms == pytest.approx(2.0)
    assert row.torch_ms == pytest.approx(4.0)
    assert row.ratio == pytest.approx(0.5)              # shardwise twice as fast
    assert row.paired_ratio == pytest.approx(0.25)      # per round 1.0, 0.25 and 1/450: median 0.25
    assert row.bubble_measured == pytest.approx(0.2)
    assert row.bubble_simulated == pytest.approx(0.1) and row.bubble_replayed == pytest.approx(0.15)
    assert row.torch_bubble_measured == pytest.approx(0.5)
    assert row.stage_ms == pytest.approx([20.0, 20.0])   # per stage, the median over rounds, in ms


def test_row_without_torch_has_no_ratio() -> None:
    row = bench.make_row(PipelineSchedule.INTERLEAVED_1F1B, 2, sw_s=[0.001], torch_s=None,
                         bubbles=[bench.Bubble(0.1, 0.1, 0.1, [0.001])], formula=0.1, torch_bubbles=None,
                         loss_diff=None, grad_diff=None, note="unsupported")
    assert row.torch_ms is None and row.ratio is None and row.paired_ratio is None
    assert row.torch_bubble_measured is None


def test_analyse_simulates_with_the_measured_costs() -> None:
    # A 1F1B trace of P = 2, M = 4 with a last stage twice as heavy: the simulation under the costs read from
    # the trace reproduces it, so a trace without any wait has measured == simulated (> the formula's 1/5).
    from shardwise.parallel.pipeline import Costs, build_schedule, simulate
    trace = simulate(build_schedule("1f1b", num_stages=2, num_microbatches=4), costs=Costs([1.0, 2.0], [2.0, 4.0]))
    records = [(r.stage, str(r.action), r.start, r.end) for r in trace.records]
    b = bench.analyse(records, PipelineSchedule.ONE_F_ONE_B, 2, 4, 1)
    assert b.measured == pytest.approx(b.simulated) == pytest.approx(b.replayed) and b.simulated > 1 / 5
    assert b.stage_s == pytest.approx([3.0, 6.0])
    # a stage that waits 1 extra unit before its last backward: the measured bubble grows, the yardstick not
    late = [(s, a, st + (1 if (s, a) == (0, "B3") else 0), en + (1 if (s, a) == (0, "B3") else 0))
            for s, a, st, en in records]
    b2 = bench.analyse(late, PipelineSchedule.ONE_F_ONE_B, 2, 4, 1)
    assert b2.simulated == pytest.approx(b.simulated) and b2.replayed == pytest.approx(b.replayed)
    assert b2.measured > b.measured


def test_torch_interleaved_support_rule() -> None:
    assert bench.torch_supports(PipelineSchedule.INTERLEAVED_1F1B, 4, 8) == ""      # 2 rounds of 4
    assert bench.torch_supports(PipelineSchedule.INTERLEAVED_1F1B, 4, 3) == ""      # 1 round
    assert "M % max(1, M // P)" in bench.torch_supports(PipelineSchedule.INTERLEAVED_1F1B, 4, 9)  # 2 rounds, 9
    assert bench.torch_supports(PipelineSchedule.ONE_F_ONE_B, 4, 9) == ""


@pytest.mark.parametrize("nproc,argv,fragment", [
    (1, [], "--nproc must be >= 2"),
    (2, ["--layers", "6"], "must be a multiple of P * V = 2 * 2"),
    (2, ["--d-model", "130"], "multiple of --heads"),
    (2, ["--layers", "3", "--partition", "flops"], "fewer than P * V = 2 * 2"),
])
def test_bad_shapes_are_rejected_before_launch(nproc: int, argv: list[str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("*", r"\*")):
        bench.launch(nproc, argv)


def test_bad_option_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.launch(2, ["--schedules", "zb"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_main_outside_the_launcher_says_how_to_run(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert bench.main([]) == 2
    assert "torch.distributed.run" in capsys.readouterr().err


def test_tiny_run_on_two_ranks(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    code = bench.launch(2, ["--d-model", "32", "--heads", "2", "--layers", "4", "--seq", "16", "--microbatches",
                            "4", "--micro-batch-size", "1", "--rounds", "2", "--warmup", "1", "--json", str(out)])
    assert code == 0, capfd.readouterr().err[-3000:]
    out_text = capfd.readouterr().out
    assert "shardwise/torch" in out_text and "measured / simulated" in out_text   # rank 0 printed both tables
    report = json.loads(out.read_text())
    assert report["config"]["world_size"] == 2
    rows = {r["schedule"]: r for r in report["rows"]}
    assert set(rows) == {"gpipe", "1f1b", "interleaved_1f1b"}
    assert rows["interleaved_1f1b"]["virtual_stages"] == 2 and rows["1f1b"]["virtual_stages"] == 1
    for r in rows.values():
        assert r["shardwise_ms"] > 0 and r["torch_ms"] > 0
        assert r["ratio"] == pytest.approx(r["shardwise_ms"] / r["torch_ms"])
        # same modules, same batch, no optimizer step: both compute the same loss and gradients
        assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5
        assert 0 <= r["bubble_measured"] < 1 and 0 <= r["bubble_simulated"] < 1 and 0 <= r["torch_bubble_measured"] < 1
        assert len(r["stage_ms"]) == 2 and all(x > 0 for x in r["stage_ms"])
    # P = 2, M = 4: (P-1)/(M+P-1) = 1/5; interleaved V = 2: (P-1)/(V*M+P-1) = 1/9
    assert rows["gpipe"]["bubble_formula"] == pytest.approx(1 / 5)
    assert rows["interleaved_1f1b"]["bubble_formula"] == pytest.approx(1 / 9)
