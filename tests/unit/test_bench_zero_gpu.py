"""The world-size-1 ZeRO benchmark prepared for a GPU session (`benchmarks.zero_gpu`): its baseline and
verdict arithmetic, its argument errors, and one tiny real run of every row and of the bandwidth section on the CPU
(the code path the GPU run takes, less CUDA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import zero_gpu as bench

ROW_NAMES = [r.name for r in bench.ROWS]
COPIES = ("plain_d2h", "plain_h2d", "zero_offload_d2h", "zero_offload_h2d")


def _row(name: str, stage: int, step_s: list[float], offloads: bool = False) -> dict:
    ms = sorted(t * 1e3 for t in step_s)
    return {"row": name, "stage": stage, "offloads": offloads, "step_s": step_s,
            "median_ms": ms[len(ms) // 2] if ms else None}


def test_ratios_pool_both_baselines_and_judge_stages_1_and_2() -> None:
    rows = [_row("stage0", 0, [0.100, 0.100, 0.100]), _row("stage1", 1, [0.104, 0.104, 0.104]),
            _row("stage2", 2, [0.110, 0.110, 0.110]), _row("stage0_repeat", 0, [0.102, 0.102, 0.102]),
            _row("stage2+offload_opt", 2, [1.0, 1.0, 1.0], offloads=True)]
    bench.add_ratios(rows)
    by = {r["row"]: r for r in rows}
    # baseline: the median of the six stage-0 steps, 0.101 s (the offload row, also stage 2, is not in it)
    assert by["stage0"]["vs_stage0"] == pytest.approx(100 / 101)
    assert by["stage0_repeat"]["vs_stage0"] == pytest.approx(102 / 101)
    assert by["stage1"]["vs_stage0"] == pytest.approx(104 / 101) and by["stage1"]["meets_target"] is True
    assert by["stage2"]["vs_stage0"] == pytest.approx(110 / 101) and by["stage2"]["meets_target"] is False
    assert by["stage2+offload_opt"]["vs_stage0"] == pytest.approx(1000 / 101)
    assert "meets_target" not in by["stage0"]


def test_a_failed_baseline_leaves_the_verdict_open() -> None:
    rows = [_row("stage0", 0, []), _row("stage1", 1, [0.1])]          # stage 0 failed: no step time
    bench.add_ratios(rows)
    assert rows[1]["vs_stage0"] is None and rows[1]["meets_target"] is None


def test_config_per_row() -> None:
    spec = {r.name: r for r in bench.ROWS}
    cfg = bench.ds_config(spec["stage3+offload_opt+param"], 4)
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                        "offload_param": {"device": "cpu", "pin_memory": True}}
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == 1.0
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 1
    assert bench.ds_config(spec["stage1"], 4)["zero_optimization"] == {"stage": 1}
    from shardwise.models import gpt_num_params
    assert gpt_num_params(bench.model_config("1b")) == 1_011_572_736          # the "1b" preset is ~1B parameters


@pytest.mark.parametrize("argv,fragment", [
    (["--device", "cpu", "--model", "tiny", "--seq", "129"], "exceeds the tiny model's seq_len 128"),
    (["--device", "cpu", "--steps", "0"], "must be an integer >= 1"),
    (["--device", "cpu", "--rows", "stage9"], "invalid choice"),
    (["--device", "cpu", "--row-budget-s", "0"], "must be > 0"),
    (["--device", "tpu"], "invalid choice")])
def test_bad_arguments_exit_2_naming_the_problem(argv: list[str], fragment: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_a_gpu_exits_2_with_the_way_out(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--model", "tiny"])                  # --device cuda is the default
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "sees no CUDA device" in err and "use --device cpu" in err


def test_refuses_a_launch_on_several_ranks(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert bench.main(["--device", "cpu", "--model", "tiny"]) == 2
    assert "world size 1" in capsys.readouterr().err


def test_every_row_and_the_bandwidth_run_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "zero_gpu.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # this machine's 2 cores are shared: oversubscribed threads take 5x longer
    try:
        assert bench.main(["--device", "cpu", "--model", "tiny", "--steps", "2", "--warmup", "1", "--seq", "32",
                           "--micro-batch", "2", "--bandwidth-reps", "2", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert not torch.distributed.is_initialized()        # the world of one it made is torn down
    result = json.loads(out.read_text())
    assert result["environment"]["torch"] == torch.__version__ and result["environment"]["device"] == "cpu"
    assert result["config"]["params"] == 1_902_720
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ROW_NAMES                       # every row, in order, none failed: all run on CPU
    for name, r in rows.items():
        assert r["error"] is None, name
        assert r["steps_timed"] == 2 and r["median_ms"] > 0 and r["tokens_per_s"] > 0, name
        assert len(r["losses"]) == 3 and r["memory_report"]["params"] > 0, name
        assert r["vs_stage0"] > 0 and r.get("cuda_peak_bytes") is None, name     # CPU: no CUDA peak
        # one seed, one data: after one update every stage has the same loss (bf16 tolerance)
        assert r["losses"][1] == pytest.approx(rows["stage0"]["losses"][1], rel=1.6e-2), name
    assert rows["stage2+offload_opt"]["warmup_steps"] == 1
    assert rows["stage3+offload_opt+param"]["pinned"] == {"masters": False, "param_shards": False}   # no CUDA: unpinned
    assert rows["stage1"]["meets_target"] in (True, False) and "meets_target" not in rows["stage3"]
    bw = result["bandwidth"]
    assert bw["numel"] == 1_902_720 and bw["bytes_fp32"] == 4 * 1_902_720
    for case in COPIES:
        assert bw[case]["median_s"] > 0 and bw[case]["gb_per_s"] > 0, case
    assert bw["d2h_ratio"] > 0 and bw["h2d_ratio"] > 0
    printed = capsys.readouterr().out
    assert "stage3+offload_opt+param" in printed and "Offload copies of 1,902,720 fp32 elements" in printed


def test_a_failing_row_is_recorded_and_the_run_goes_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = bench.ds_config

    def broken_stage1(spec: bench.RowSpec, micro_batch: int) -> dict:
        cfg = real(spec, micro_batch)
        if spec.name == "stage1":
            cfg["zero_optimization"]["reduce_bucket_size"] = 0      # rejected by shardwise.initialize
        return cfg
    monkeypatch.setattr(bench, "ds_config", broken_stage1)
    out = tmp_path / "partial.json"
    assert bench.main(["--device", "cpu", "--model", "tiny", "--steps", "1", "--warmup", "0", "--seq", "16",
                       "--micro-batch", "1", "--rows", "stage0", "stage1", "stage2", "--bandwidth-reps", "1",
                       "--json", str(out)]) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["stage0", "stage1", "stage2"]
    assert "reduce_bucket_size" in rows["stage1"]["error"] and rows["stage1"]["median_ms"] is None
    assert rows["stage1"]["meets_target"] is None                     # no verdict without a time
    assert rows["stage2"]["error"] is None and rows["stage2"]["median_ms"] > 0
