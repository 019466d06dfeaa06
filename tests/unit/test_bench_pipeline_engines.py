"""`shardwise bench pipeline_engines`: argument errors before launch, and one tiny real run on 2 ranks against
DeepSpeed's PipelineEngine (same first-step loss, positive times)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import pipeline_engines as bench


@pytest.mark.parametrize("nproc,argv,fragment", [
    (1, [], "--nproc must be >= 2"),
    (4, ["--layers", "3"], "fewer than the 4 stages"),
])
def test_bad_shapes_are_rejected_before_launch(nproc: int, argv: list[str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        bench.launch(nproc, argv)


def test_main_outside_the_launcher_says_how_to_run(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert bench.main([]) == 2
    assert "launcher" in capsys.readouterr().err


def test_tiny_run_against_deepspeed(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "engines.json"
    code = bench.launch(2, ["--d-model", "32", "--layers", "4", "--seq", "16", "--microbatches", "4",
                            "--rounds", "2", "--warmup", "1", "--json", str(out)])
    assert code == 0, capfd.readouterr().err[-3000:]
    assert "shardwise / DeepSpeed" in capfd.readouterr().out
    report = json.loads(out.read_text())
    assert report["shardwise_ms"] > 0 and report["deepspeed_ms"] > 0
    first = report["first_loss"]     # the same model, data and schedule: the same loss
    assert first["shardwise"] == pytest.approx(first["deepspeed"], rel=1e-5)
