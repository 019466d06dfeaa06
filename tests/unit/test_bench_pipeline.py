"""The pipeline benchmark: its arithmetic, its argument errors, and one tiny real run on 2 ranks through
torch's elastic launcher (the path `shardwise bench pipeline --nproc 2` takes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.benchmarks import pipeline as bench
from shardwise.config.resolved import PipelineSchedule


def test_row_uses_medians_and_shardwise_over_torch_ratio() -> None:
    row = bench.make_row(PipelineSchedule.ONE_F_ONE_B, 1, sw_s=[0.004, 0.001, 0.002], torch_s=[0.004, 0.004, 0.9],
                         bubbles=[0.3, 0.1, 0.2], formula=0.25, loss_diff=0.0, grad_diff=1e-7)
    assert row.shardwise_ms == pytest.approx(2.0)
    assert row.torch_ms == pytest.approx(4.0)
    assert row.ratio == pytest.approx(0.5)              # shardwise twice as fast
    assert row.paired_ratio == pytest.approx(0.25)      # per round 1.0, 0.25 and 1/450: median 0.25
    assert row.bubble_measured == pytest.approx(0.2)


def test_row_without_torch_has_no_ratio() -> None:
    row = bench.make_row(PipelineSchedule.INTERLEAVED_1F1B, 2, sw_s=[0.001], torch_s=None, bubbles=[0.1],
                         formula=0.1, loss_diff=None, grad_diff=None, note="unsupported")
    assert row.torch_ms is None and row.ratio is None and row.paired_ratio is None


def test_torch_interleaved_support_rule() -> None:
    assert bench.torch_supports(PipelineSchedule.INTERLEAVED_1F1B, 4, 8) == ""      # 2 rounds of 4
    assert bench.torch_supports(PipelineSchedule.INTERLEAVED_1F1B, 4, 3) == ""      # 1 round
    assert "M % max(1, M // P)" in bench.torch_supports(PipelineSchedule.INTERLEAVED_1F1B, 4, 9)  # 2 rounds, 9
    assert bench.torch_supports(PipelineSchedule.ONE_F_ONE_B, 4, 9) == ""


@pytest.mark.parametrize("nproc,argv,fragment", [
    (1, [], "--nproc must be >= 2"),
    (2, ["--layers", "6"], "must be a multiple of P * V = 2 * 2"),
    (2, ["--d-model", "130"], "multiple of --heads"),
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
    assert "shardwise/torch" in capfd.readouterr().out   # rank 0 printed the table
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
        assert 0 <= r["bubble_measured"] < 1
    # P = 2, M = 4: (P-1)/(M+P-1) = 1/5; interleaved V = 2: (P-1)/(V*M+P-1) = 1/9
    assert rows["gpipe"]["bubble_formula"] == pytest.approx(1 / 5)
    assert rows["interleaved_1f1b"]["bubble_formula"] == pytest.approx(1 / 9)
