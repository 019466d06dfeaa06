"""`shardwise plan`: model/cluster/job inputs, JSON and table output, config and plot files, calibration."""

from __future__ import annotations

import json
import os

import pytest

from shardwise.cli.main import main
from shardwise.config import load_config_for_world
from shardwise.models.presets import PRESETS, gpt_num_params
from shardwise.planner import ClusterSpec, PlannerError, cluster_preset
from shardwise.planner.calibrate import calibrate, load_cluster, save_cluster

TINY = ["--model", "tiny", "--gpus", "2", "--global-batch", "8"]


def _json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys, *argv: str) -> str:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("shardwise: error: ")
    return err


def test_json_report_for_a_preset(capsys) -> None:
    out = _json(capsys, *TINY)
    assert out["model"]["params"] == gpt_num_params(PRESETS["tiny"])
    assert out["cluster"]["num_gpus"] == 2 and out["cluster"]["gpus_per_node"] == 2
    plan = out["plan"]
    assert plan["feasible"] and plan["plan"]["dp"] * plan["plan"]["tp"] * plan["plan"]["pp"] == 2
    assert plan["step_time"]["total_s"] > 0 and 0 < plan["mfu"] < 1
    # one gradient bucket reduces after the backward, exposed either way: ZeRO-1/2's smaller step can win
    stage = plan["plan"]["zero_stage"]
    assert [c["op"] for c in out["communication"]] == (["all_reduce"] if stage == 0 else
                                                       ["reduce_scatter", "all_gather"])
    assert {r["strategy"] for r in out["memory_by_strategy"]} >= {"DP (ZeRO-0)", "ZeRO-3"}
    assert out["flops"]["convention"].startswith("attention scores not halved")
    assert out["rule_of_thumb"]["strategy"] == "data parallelism"
    assert out["search"]["ranked"][0]["label"]


def test_tables_are_printed(capsys) -> None:
    assert main(["plan", "--model", "gpt2-124m", "--cluster", "h100-80gb", "--global-batch", "64"]) == 0
    text = capsys.readouterr().out
    for needle in ("Model gpt2-124m", "Memory per GPU", "Recommended plan", "Communication per step",
                   "Rule of thumb (DP if it fits", "Layouts that cannot run"):
        assert needle in text


def test_model_as_numbers_and_as_hf_config(capsys, tmp_path) -> None:
    numbers = _json(capsys, "--layers", "12", "--hidden", "768", "--heads", "12", "--vocab", "50257", "--seq", "1024")
    assert numbers["model"]["params"] == 124_439_808 + 768 * 50257 * 0     # GPT-2 small, tied
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                              "num_attention_heads": 32, "num_hidden_layers": 32, "vocab_size": 32000,
                              "max_position_embeddings": 2048, "hidden_act": "silu"}))
    assert _json(capsys, "--hf-config", str(hf), "--gpus", "8")["model"]["params"] == 6_738_415_616
    hf.write_text(json.dumps({"model_type": "bert"}))
    assert "model_type = 'bert' is not supported" in _error(capsys, "--hf-config", str(hf))


def test_user_errors_are_one_line(capsys) -> None:
    assert "give exactly one model" in _error(capsys)
    assert "did you mean 'llama-7b'" in _error(capsys, "--model", "llama-7")
    assert "needs --vocab, --seq as well" in _error(capsys, "--layers", "2", "--hidden", "64", "--heads", "4")
    assert "d_model=64 is not divisible by n_head=5" in _error(
        capsys, "--layers", "2", "--hidden", "64", "--heads", "5", "--vocab", "10", "--seq", "8")
    assert "unknown cluster preset 'a100'" in _error(capsys, *TINY[:2], "--cluster", "a100")


def test_one_given_plan_is_evaluated(capsys) -> None:
    out = _json(capsys, *TINY, "--dp", "2", "--zero", "0", "--micro-batch", "2")
    assert out["plan"]["label"] == "dp2 tp1 pp1 zero0 mb2" and "search" not in out
    assert out["plan"]["step_time"]["microbatches"] == 2
    bad = _json(capsys, "--model", "llama-7b", "--gpus", "1", "--dp", "1")
    assert not bad["plan"]["feasible"] and "over by" in bad["plan"]["problems"][0]["detail"]
    assert "no runnable plan to write" in _error(capsys, "--model", "llama-7b", "--gpus", "1", "--dp", "1",
                                                  "--write-config", "x.json")


def test_write_config_and_plot(capsys, tmp_path) -> None:
    cfg, png = tmp_path / "ds.json", tmp_path / "memory.png"
    assert main(["plan", *TINY, "--precision", "fp32", "--write-config", str(cfg), "--plot", str(png)]) == 0
    assert "Wrote" in capsys.readouterr().out
    assert png.stat().st_size > 1000
    config = load_config_for_world(str(cfg), world_size=2)
    assert config.batch.train_batch_size == 8 and config.precision.dtype.value == "fp32"


def test_cluster_overrides_and_files(capsys, tmp_path) -> None:
    out = _json(capsys, *TINY, "--gpu-memory-gb", "40", "--peak-tflops", "100", "--inter-bw-gbs", "12.5",
                "--efficiency", "0.5")
    c = out["cluster"]
    assert (c["memory_bytes"], c["peak_flops_bf16"], c["inter_node_bw"], c["compute_efficiency"]) == (
        40e9, 100e12, 12.5e9, 0.5)
    path = tmp_path / "cluster.json"
    save_cluster(cluster_preset("h200", num_gpus=16), path)
    assert _json(capsys, "--model", "tiny", "--cluster", str(path))["cluster"]["num_gpus"] == 16
    path.write_text(json.dumps({**cluster_preset("h200").to_dict(), "nvlink": 1}))
    assert "unknown key(s) nvlink" in _error(capsys, "--model", "tiny", "--cluster", str(path))


def test_calibration_measures_this_machine(tmp_path) -> None:
    cluster = calibrate(ranks=2, rounds=1, samples=1)
    assert cluster.num_gpus == 2 and cluster.compute_efficiency == 1.0
    assert 1e8 < cluster.peak_flops_fp32 < 1e13          # one CPU core: 0.1 to 10,000 GFLOP/s
    assert 1e8 < cluster.attention_flops < 1e13 and 0 < cluster.activation_s < 1e-6 and 0 < cluster.norm_s < 1e-6
    assert 0 <= cluster.layer_overhead_s < 0.1 and 0 <= cluster.optimizer_tensor_s < 0.01
    assert 1e6 < cluster.intra_node_bw < 1e12 and 0 <= cluster.intra_node_latency_s < 0.01
    assert 1e6 < cluster.reduce_scatter_bw < 1e12 and 1e6 < cluster.all_gather_bw < 1e12
    assert 1e8 < cluster.memory_bw < 1e13 and cluster.cache_bw > 0
    assert cluster.comm_overlap == min(1.0, max(0.0, ((os.cpu_count() or 1) - 2) / 2))
    assert cluster.memory_bytes * 2 == pytest.approx(cluster.host_memory_bytes)
    path = tmp_path / "calibration.json"
    save_cluster(cluster, path)
    assert load_cluster(path) == cluster
    with pytest.raises(PlannerError, match="missing 1 required keyword-only argument: 'num_gpus'"):
        ClusterSpec.from_dict({k: v for k, v in cluster.to_dict().items() if k != "num_gpus"})


def test_calibrate_flag_saves_and_plans(capsys, tmp_path, monkeypatch) -> None:
    measured = cluster_preset("a100-80gb", num_gpus=2).replace(name="calibrated:test")
    monkeypatch.setattr("shardwise.planner.calibrate.calibrate", lambda **kw: measured.replace(num_gpus=kw["ranks"]))
    path = tmp_path / "out.json"
    out = _json(capsys, *TINY, "--calibrate", str(path))
    assert out["cluster"]["name"] == "calibrated:test" and load_cluster(path) == measured
    assert os.path.exists(path)


def test_deepspeed_style_zero3_and_megatron_pipeline_options(capsys) -> None:
    zero3 = ["--model", "gpt3-175b", "--gpus", "384", "--global-batch", "1536", "--dp", "384", "--zero", "3",
             "--micro-batch", "4", "--recompute", "full"]
    ours, deepspeed = _json(capsys, *zero3), _json(capsys, *zero3, "--zero3-gather", "module")
    assert deepspeed["plan"]["memory"]["buffers"] < ours["plan"]["memory"]["buffers"] / 3
    assert 0 < deepspeed["plan"]["mfu"] < deepspeed["plan"]["hfu"] < 1 and deepspeed["reason"] is None   # given
    pipe = ["--model", "gpt3-175b", "--gpus", "64", "--global-batch", "64", "--tp", "8", "--pp", "8",
            "--recompute", "full", "--no-sequence-parallel"]
    plain, sg = _json(capsys, *pipe), _json(capsys, *pipe, "--pp-scatter-gather")
    assert sg["plan"]["step_time"]["pp_comm_s"] < plain["plan"]["step_time"]["pp_comm_s"] / 4
    assert "zero3_prefetch_elements = -1: must be an integer >= 0" in _error(capsys, *TINY, "--zero3-prefetch", "-1")
