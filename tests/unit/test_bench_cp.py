"""`shardwise bench cp`: its argument errors (before any rank starts), which trainers a model and world allow, the
longest-sequence walk, the report's lines, and one small real run on 2 ranks through torch's elastic launcher."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import cp as bench
from shardwise.cli.main import main as cli_main


@pytest.mark.parametrize("nproc,argv,fragment", [
    (1, [], "needs at least 2 ranks"),
    (4, ["--seq", "100"], "--seq 100 does not cut into 2 x 4 chunks"),
    (2, ["--seq", "34"], "--seq 34 does not cut into 2 x 2 chunks"),
    (2, ["--heads", "8", "--kv-heads", "3"], "--heads 8 is not a multiple of --kv-heads 3"),
    (2, ["--heads", "5", "--kv-heads", "5"], "--heads 5 does not divide the preset's d_model 384"),
])
def test_bad_options_are_refused_before_launch(nproc: int, argv: list[str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        bench.launch(nproc, argv)


@pytest.mark.parametrize("argv,fragment", [(["--rounds", "0"], "must be an integer >= 1"),
                                           (["--seq", "8"], "must be an integer >= 16"),
                                           (["--budget-mib", "x"], "argument --budget-mib")])
def test_bad_option_exits_2(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.launch(2, argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_trainers_follow_the_model_and_the_world() -> None:
    names = lambda *a: [t[0] for t in bench.trainers(*a)]  # noqa: E731
    assert names(4, 8, 2, True) == ["cp1", "ring2", "allgather2", "ulysses2", "deepspeed2", "ring4", "allgather4",
                                    "ulysses4", "deepspeed4"]
    # the preset's 6 heads do not spread over 4 Ulysses ranks: ring only at 4
    assert names(4, 6, 2, True) == ["cp1", "ring2", "allgather2", "ulysses2", "deepspeed2", "ring4", "allgather4"]
    assert names(2, 8, 2, False) == ["cp1", "ring2", "allgather2", "ulysses2"]
    assert names(6, 8, 2, False) == ["cp1", "ring2", "allgather2", "ulysses2"]          # 4 does not divide 6


def test_walk_finds_the_boundary_from_either_side() -> None:
    limit = 1000                                        # fits up to 1000 tokens
    fits = lambda n: (n <= limit, float(n))  # noqa: E731
    longest, probes = bench.walk_to_boundary(832, 64, fits)
    assert longest == 960 and [p[0] for p in probes] == [832, 896, 960, 1024]
    longest, probes = bench.walk_to_boundary(1152, 64, fits)
    assert longest == 960 and [p[0] for p in probes] == [1152, 1088, 1024, 960]
    assert [p[1] for p in probes] == [False, False, False, True]
    with pytest.raises(ValueError, match="no fit boundary within 3 measured steps"):
        bench.walk_to_boundary(64, 64, fits, max_probes=3)
    with pytest.raises(ValueError, match="no fit boundary"):
        bench.walk_to_boundary(128, 64, lambda n: (False, 0.0))      # nothing fits, down to one quantum


def test_planner_longest_grows_with_cp() -> None:
    from shardwise.models import gpt_config
    model = lambda n: gpt_config("llama-small", seq_len=n)  # noqa: E731
    one = bench.planner_longest(model, 1, 1, 192 * 2**20, 80e6, 64, 4)
    four = bench.planner_longest(model, 4, 1, 192 * 2**20, 80e6, 64, 4)
    assert one % 64 == 0 and four % 64 == 0 and 3.5 * one <= four <= 4.5 * one


def test_report_lines() -> None:
    row = dict(trainer="ring2", cp=2, impl="ring", attention="shardwise", median_ms=10.0, round_min_ms=9.0,
               round_max_ms=12.0, ratio_to_ours=1.0, paired_ratio_to_ours=1.0, activations=2 * 2**20,
               predicted=2.1 * 2**20, times_cp1_over_c=0.95, first_loss=5.5)
    other = dict(row, trainer="allgather2", attention="allgather", median_ms=11.0, ratio_to_ours=1.1,
                 predicted=math.nan)
    result = {"config": dict(heads=8, kv_heads=2, layers=None, params=123, ranks=2, micro_batch=1, seq=64, rounds=2,
                                 load_average=7.5),
              "rows": [row, other], "torch_context_parallel": "torch's context_parallel does not run on the CPU",
              "attention_alone": [{"cp": 2, "passes": 6, "ring_ms": 40.0, "allgather_ms": 50.0, "ratio": 0.8,
                                   "paired_ratio": 0.75}],
              "longest": {"budget_bytes": 64 * 2**20, "quantum": 32, "ratio": 1.9,
                          "sizes": {"1": {"longest": 320, "planner": 320, "model_states": 2**20, "probes": [1, 2]},
                                    "2": {"longest": 608, "planner": 576, "model_states": 2**20, "probes": [1]}}}}
    text = "\n".join(bench.report_lines(result))
    assert "8 heads / 2 kv heads (123 params), 2 ranks" in text and "load average 7.5" in text
    lines = text.splitlines()
    assert lines[2].split()[:3] == ["ring2", "2", "10.0"] and "2.00" in lines[2] and "2.10" in lines[2]
    assert lines[3].split()[:6] == ["allgather2", "2", "11.0", "9.0-12.0", "1.100", "1.000"]
    assert "does not run on the CPU" in text
    assert ("Attention alone at cp 2 (one layer, forward + backward, median of 6): ring 40.0 ms, all-gather 50.0 ms, "
            "ring / all-gather 0.800 (paired 0.750)") in text
    assert "cp 1: 320 tokens (planner 320" in text and "cp 2: 608 tokens" in text and "ratio 1.90x" in text


def test_cli_lists_cp_and_refuses_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "cp", "--help"]) == 0
    assert "--budget-mib" in capsys.readouterr().out
    assert cli_main(["bench", "cp", "--nproc", "1"]) == 2
    assert "needs at least 2 ranks" in capsys.readouterr().err


def test_small_run_on_two_ranks(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cp.json"
    code = bench.launch(2, ["--layers", "1", "--seq", "64", "--rounds", "1", "--no-deepspeed", "--budget-mib", "20",
                            "--json", str(out)])
    assert code == 0, capfd.readouterr().err[-3000:]
    assert "Longest trainable sequence" in capfd.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["trainer"]: r for r in report["rows"]}
    assert list(rows) == ["cp1", "ring2", "allgather2", "ulysses2"]
    # every trainer computes the same loss on the same batch (fp32; summation orders differ)
    assert all(r["first_loss"] == pytest.approx(rows["cp1"]["first_loss"], rel=1e-5) for r in rows.values())
    assert all(r["median_ms"] > 0 for r in rows.values())
    for name in ("cp1", "ring2", "ulysses2"):
        assert abs(rows[name]["activations"] / rows[name]["predicted"] - 1) <= 0.10, rows[name]
    assert rows["allgather2"]["activations"] > rows["ring2"]["activations"]      # it holds every key and value
    (alone,) = report["attention_alone"]
    assert alone["cp"] == 2 and alone["passes"] == 3 and alone["ring_ms"] > 0 and alone["allgather_ms"] > 0
    sizes = report["longest"]["sizes"]
    assert sizes["2"]["longest"] > sizes["1"]["longest"]
    for s in sizes.values():           # the walk ended on a boundary: the longest fits, its neighbour does not
        fitted = {p["seq"]: p["fits"] for p in s["probes"]}
        assert fitted.get(s["longest"]) is not False
        assert fitted[s["longest"] + report["longest"]["quantum"]] is False
