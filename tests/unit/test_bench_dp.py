"""The data-parallel benchmark: its summary arithmetic, its round order, its argument errors, and one tiny real
run on 2 ranks through torch's elastic launcher (the path `shardwise bench dp --nproc 2` takes)."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from benchmarks import dp as bench

TINY_PARAMS = 1_902_720          # gpt_num_params(gpt_config("tiny"))
TINY_TENSORS = 69                # parameters of the tiny GPT (AdamW keeps one fp32 `step` scalar for each)


def test_summary_uses_medians_and_shardwise_over_other_ratio() -> None:
    times = {"shardwise": [[0.010, 0.012, 0.011], [0.020, 0.011, 0.013]],     # median of all six: 0.0115
             "ddp": [[0.023, 0.023, 0.500], [0.022, 0.024, 0.021]]}           # median: 0.023
    memory = {name: {"params": 40, "grads": 40, "optimizer": 80} for name in times}
    rows = {r.trainer: r for r in bench.summarize(times, memory, tokens_per_step=1000)}
    assert rows["shardwise"].median_ms == pytest.approx(11.5)
    assert rows["shardwise"].round_min_ms == pytest.approx(11.0)
    assert rows["shardwise"].round_max_ms == pytest.approx(13.0)
    assert rows["shardwise"].shardwise_ratio == pytest.approx(1.0)
    assert rows["ddp"].median_ms == pytest.approx(23.0)
    assert rows["ddp"].shardwise_ratio == pytest.approx(0.5)                  # shardwise twice as fast
    # per round: 0.011 / 0.023 and 0.013 / 0.022, median = their mean
    assert rows["ddp"].paired_ratio == pytest.approx((0.011 / 0.023 + 0.013 / 0.022) / 2)
    assert rows["shardwise"].paired_ratio == pytest.approx(1.0)
    assert rows["ddp"].tokens_per_s == pytest.approx(1000 / 0.023)
    assert rows["ddp"].model_states_bytes == 160


def test_rounds_rotate_the_order() -> None:
    names = ["shardwise", "ddp", "deepspeed"]
    assert [bench.rotation(names, r) for r in range(4)] == [
        ["shardwise", "ddp", "deepspeed"], ["ddp", "deepspeed", "shardwise"],
        ["deepspeed", "shardwise", "ddp"], ["shardwise", "ddp", "deepspeed"]]


def test_one_config_for_all_trainers() -> None:
    args = bench.parse_args(["--micro-batch", "3", "--bucket-mb", "2"])
    cfg = bench.ds_config(args)
    assert cfg["train_micro_batch_size_per_gpu"] == 3
    assert cfg["zero_optimization"] == {"stage": 0, "reduce_bucket_size": 2 * 2 ** 20 // 4}   # fp32 elements
    assert cfg["optimizer"]["params"]["torch_adam"] is True     # DeepSpeed steps torch's AdamW, as the others
    assert args.seq_len == 128                                  # the tiny preset's


def test_stage_picks_the_counterparts_and_offload_reaches_the_config() -> None:
    assert "fsdp2" in bench.parse_args(["--zero-stage", "3"]).trainers
    assert not {"ddp", "fsdp2"} & set(bench.parse_args(["--zero-stage", "2"]).trainers)
    assert "fsdp2" not in bench.parse_args([]).trainers
    args = bench.parse_args(["--zero-stage", "2", "--offload"])
    assert bench.ds_config(args)["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert "offload_optimizer" not in bench.ds_config(bench.parse_args(["--zero-stage", "2"]))["zero_optimization"]
    args = bench.parse_args(["--zero-stage", "3", "--offload", "--persistence-threshold", "0"])
    zero = bench.ds_config(args)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu"} and zero["stage3_param_persistence_threshold"] == 0
    assert "stage3_param_persistence_threshold" not in bench.ds_config(bench.parse_args(["--zero-stage", "3"]))[
        "zero_optimization"]


@pytest.mark.parametrize("argv,fragment", [(["--steps", "0"], "must be an integer >= 1"),
                                           (["--model", "huge"], "invalid choice"),
                                           (["--seq-len", "129"], "exceeds the tiny model's seq_len 128"),
                                           (["--bucket-mb", "0"], "must be > 0"),
                                           (["--zero-stage", "3", "--trainers", "ddp"],
                                            "ddp has a counterpart only at stage(s) 0"),
                                           (["--trainers", "fsdp2"], "fsdp2 has a counterpart only at stage(s) 3"),
                                           (["--offload"], "use --zero-stage 1, 2 or 3"),
                                           (["--zero-stage", "2", "--persistence-threshold", "0"],
                                            "use --zero-stage 3 or leave it out")])
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


def _tiny_run(tmp_path: Path, trainers: list[str], extra: tuple[str, ...] = ()) -> dict:
    out = tmp_path / "dp.json"
    code = bench.launch(2, ["--model", "tiny", "--seq-len", "16", "--micro-batch", "1", "--steps", "2",
                            "--warmup", "1", "--rounds", "2", "--trainers", *trainers, "--json", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def _check_rows(result: dict, expected: list[str]) -> None:
    rows = {r["trainer"]: r for r in result["rows"]}
    assert list(rows) == expected
    for name, row in rows.items():
        times = result["step_times_s"][name]
        assert len(times) == 2 and all(len(rnd) == 2 and all(t > 0 for t in rnd) for rnd in times)
        assert row["median_ms"] > 0 and row["tokens_per_s"] > 0
        # Every trainer holds fp32 parameters and one fp32 gradient per parameter (shardwise's buckets, DDP's
        # bucket views, DeepSpeed's .grad), and AdamW's two moments plus a `step` scalar per tensor.
        assert row["params_bytes"] == 4 * TINY_PARAMS, name
        assert row["grads_bytes"] == 4 * TINY_PARAMS, name
        assert row["optimizer_bytes"] == 8 * TINY_PARAMS + 4 * TINY_TENSORS, name
    # The ratios are recomputed from the raw step times: shardwise's median over this trainer's, overall and
    # per round (the paired ratio is the median of the per-round ratios).
    times = result["step_times_s"]
    for name, row in rows.items():
        overall = statistics.median(times["shardwise"][0] + times["shardwise"][1]) / statistics.median(
            times[name][0] + times[name][1])
        paired = statistics.median(statistics.median(a) / statistics.median(b)
                                   for a, b in zip(times["shardwise"], times[name]))
        assert row["shardwise_ratio"] == pytest.approx(overall, rel=1e-12), name
        assert row["paired_ratio"] == pytest.approx(paired, rel=1e-12), name
        assert row["median_ms"] == pytest.approx(statistics.median(times[name][0] + times[name][1]) * 1e3), name
    assert len(result["peak_rss_bytes_per_rank"]) == 2
    for name, phases in result["phase_median_s"].items():     # forward, backward, update: each timed apart
        assert list(phases) == ["forward", "backward", "update"] and all(t > 0 for t in phases.values()), name
        assert sum(phases.values()) >= 0.5 * rows[name]["median_ms"] / 1e3, name


def test_tiny_run_on_two_ranks(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    result = _tiny_run(tmp_path, ["ddp"])
    assert "shardwise / this" in capfd.readouterr().out      # rank 0 printed the table
    _check_rows(result, ["shardwise", "ddp"])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_tiny_run_with_deepspeed(tmp_path: Path) -> None:
    _check_rows(_tiny_run(tmp_path, ["ddp", "deepspeed"]), ["shardwise", "ddp", "deepspeed"])


def test_tiny_stage3_run_against_fsdp2(tmp_path: Path) -> None:
    result = _tiny_run(tmp_path, ["fsdp2"], ("--zero-stage", "3"))
    rows = {r["trainer"]: r for r in result["rows"]}
    assert list(rows) == ["shardwise", "fsdp2"]
    assert all(r["median_ms"] > 0 for r in rows.values())
    half = TINY_PARAMS // 2      # every tiny tensor splits evenly over 2 ranks
    # FSDP2 shards every parameter: half the fp32 parameters, gradients and moments on each rank (plus AdamW's
    # `step` scalar per tensor); no master copy.
    assert (rows["fsdp2"]["params_bytes"], rows["fsdp2"]["grads_bytes"]) == (4 * half, 4 * half)
    assert rows["fsdp2"]["optimizer_bytes"] == 8 * half + 4 * TINY_TENSORS
    # shardwise: half the gradients; its moments of half the parameters (its flat shards, a few `step` scalars);
    # parameters above half only by the small ones kept whole (stage3_param_persistence_threshold).
    assert rows["shardwise"]["grads_bytes"] == 4 * half
    assert 8 * half < rows["shardwise"]["optimizer_bytes"] < 8 * half + 4 * TINY_TENSORS
    assert 4 * half <= rows["shardwise"]["params_bytes"] < 4 * TINY_PARAMS
