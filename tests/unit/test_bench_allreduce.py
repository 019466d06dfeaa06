"""The all-reduce benchmark: its arithmetic, its argument errors, and one tiny real run on 2 ranks
through torch's elastic launcher (the path `shardwise bench allreduce --nproc 2` takes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import allreduce as bench


def test_bus_bandwidth_follows_nccl_tests() -> None:
    assert bench.algorithm_bandwidth(2 ** 20, 0.001) == pytest.approx(1_048_576_000.0)
    # busbw = algbw * 2(n-1)/n
    assert bench.bus_bandwidth(1e9, 2) == pytest.approx(1e9)
    assert bench.bus_bandwidth(1e9, 4) == pytest.approx(1.5e9)
    assert bench.bus_bandwidth(1e9, 8) == pytest.approx(1.75e9)
    assert bench.bus_bandwidth(1e9, 1) == 0.0


def test_row_uses_medians_and_ours_over_backend_ratio() -> None:
    row = bench.make_row(4.0, 4 * 2 ** 20, 4, ours_s=[0.004, 0.001, 0.002], backend_s=[0.004, 0.004, 0.9],
                         results_match=True)
    assert row.ours_ms == pytest.approx(2.0)
    assert row.backend_ms == pytest.approx(4.0)
    assert row.ours_algbw_gbps == pytest.approx(4 * 2 ** 20 / 0.002 / 1e9)
    assert row.ours_busbw_gbps == pytest.approx(row.ours_algbw_gbps * 1.5)
    assert row.backend_busbw_gbps == pytest.approx(4 * 2 ** 20 / 0.004 / 1e9 * 1.5)
    assert row.ratio == pytest.approx(2.0)          # ours is twice as fast
    assert row.paired_ratio == pytest.approx(4.0)   # per iteration 1.0, 4.0 and 450: median 4.0


@pytest.mark.parametrize("argv,fragment", [(["--sizes-mb", "0"], "sizes must be > 0"),
                                           (["--iters", "0"], "must be an integer >= 1"),
                                           (["--dtype", "float8"], "invalid choice")])
def test_bad_arguments_exit_2_naming_the_problem(argv: list[str], fragment: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.launch(2, argv)                       # rejected before any process starts
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_launch_needs_two_ranks() -> None:
    with pytest.raises(ValueError, match="--nproc must be >= 2"):
        bench.launch(1, [])


def test_main_outside_the_launcher_says_how_to_run(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert bench.main([]) == 2
    assert "torch.distributed.run" in capsys.readouterr().err


@pytest.mark.parametrize("ours", ["ring", "shm"])
def test_tiny_run_on_two_ranks(ours: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    code = bench.launch(2, ["--sizes-mb", "0.01", "0.1", "--iters", "3", "--warmup", "1", "--segment-kb", "16",
                            "--ours", ours, "--json", str(out)])
    assert code == 0, capfd.readouterr().err[-3000:]
    assert f"{ours} busbw" in capfd.readouterr().out          # rank 0 printed the table
    report = json.loads(out.read_text())
    assert report["config"]["world_size"] == 2 and report["config"]["backend"] == "gloo"
    assert report["config"]["ours"] == ours
    rows = report["rows"]
    assert [r["nbytes"] for r in rows] == [int(0.01 * 2 ** 20) // 4 * 4, int(0.1 * 2 ** 20) // 4 * 4]
    for r in rows:
        assert r["results_match"] is True
        assert r["ours_ms"] > 0 and r["backend_ms"] > 0
        assert r["ours_busbw_gbps"] == pytest.approx(r["ours_algbw_gbps"])      # n = 2: factor 1
        assert r["ratio"] == pytest.approx(r["ours_busbw_gbps"] / r["backend_busbw_gbps"])
