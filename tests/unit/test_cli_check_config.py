"""`shardwise check-config` and the CLI's error contract: user errors exit 2 with one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli.main import SUBCOMMANDS, build_parser, main

GOOD = {
    "train_batch_size": 32,
    "gradient_accumulation_steps": 2,
    "fp16": {"enabled": True, "initial_scale_power": 12},
    "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 100}},
    "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e8},
    "communication": {"all_reduce": "ring"},
}


def write(tmp_path: Path, config: dict | str, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


def assert_one_line_error(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("shardwise: error: ") and "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_prints_the_resolved_table(tmp_path: Path, capsys: pytest.CaptureFixture,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps to the terminal width; keep phrases on one line
    assert main(["check-config", write(tmp_path, GOOD), "--world", "4"]) == 0
    out = capsys.readouterr().out
    assert "train_micro_batch_size_per_gpu 4" in out and "gradient_accumulation_steps 2" in out
    assert "torch.optim.AdamW" in out and "2^12" in out and "ring" in out and "WarmupDecayLR" in out
    assert re.search(r"│ monitoring\s+│ none\s+│", out)
    monitored = {**GOOD, "steps_per_print": 5, "csv_monitor": {"enabled": True, "output_path": "logs"},
                 "flops_profiler": {"enabled": True, "profile_step": 3}}
    assert main(["check-config", write(tmp_path, monitored, "m.json"), "--world", "4"]) == 0
    out = capsys.readouterr().out
    assert "csv_monitor -> logs/DeepSpeedJobName, progress every 5 steps, flops_profiler at step 3" in out
    ulysses = {**GOOD, "train_batch_size": 16, "sequence_parallel_size": 2}
    assert main(["check-config", write(tmp_path, ulysses, "u.json"), "--world", "4"]) == 0
    out = capsys.readouterr().out
    assert "2 = world 4 / (tensor_parallel 1 * pipeline 1 * context_parallel 2 ulysses)" in out


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["check-config", write(tmp_path, GOOD), "--world", "2", "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["batch"] == {
        "train_batch_size": 32, "micro_batch": 8, "grad_accum": 2, "dp_size": 2,
        "derived": ["train_micro_batch_size_per_gpu"],
        "arithmetic": "train_batch_size 32 = train_micro_batch_size_per_gpu 8 * gradient_accumulation_steps 2 * "
                      "data-parallel size 2"}
    assert described["precision"]["dtype"] == "fp16" and described["precision"]["initial_loss_scale"] == 4096.0
    assert described["zero"]["stage"] == 0 and described["communication"]["all_reduce"] == "ring"
    assert described["optimizer"]["torch"].startswith("torch.optim.AdamW(")
    assert described["world_size"] == 2


@pytest.mark.parametrize("config,world,fragments", [
    ({**GOOD, "zero_optimisation": {}}, 4, ['unknown key "zero_optimisation"', 'did you mean "zero_optimization"']),
    (GOOD, 3, ["train_batch_size 32 is not a multiple of gradient_accumulation_steps 2 * data-parallel size 3 = 6"]),
    ({**GOOD, "comet": {"enabled": True}}, 4, ["does not implement DeepSpeed's Comet monitor"]),
    ({**GOOD, "optimizer": {"type": "SGD", "params": {"momentom": 0.9}}}, 4, ['did you mean "momentum"']),
    ({**GOOD, "scheduler": {"type": "WarmupDecayLR", "params": {}}}, 4, ["total_num_steps"]),
])
def test_config_problems_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, config: dict,
                                              world: int, fragments: list[str]) -> None:
    assert main(["check-config", write(tmp_path, config), "--world", str(world)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_line_error(captured.err, *fragments)


def test_several_problems_print_one_line_each(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = {"train_batch_size": "auto", "fp16": {"enabeld": True}, "optimizer": {"type": "Adam",
                                                                                   "params": {"lr": "auto"}}}
    assert main(["check-config", write(tmp_path, config)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("shardwise: error: ") for line in lines)
    assert lines[0].startswith('shardwise: error: "train_batch_size": "auto" needs the micro-batch size')
    assert 'unknown key "fp16.enabeld"' in lines[1] and '"optimizer.params.lr": "auto"' in lines[2]


def test_missing_and_malformed_files_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["check-config", str(tmp_path / "absent.json")]) == 2
    assert_one_line_error(capsys.readouterr().err, "cannot read config file", "absent.json")
    assert main(["check-config", write(tmp_path, '{"train_batch_size": 8,,}')]) == 2
    assert_one_line_error(capsys.readouterr().err, "is not valid JSON: line 1")


@pytest.mark.parametrize("argv", [[], ["check-config"], ["check-config", "x.json", "--world", "0"], ["nonsense"]])
def test_argparse_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "usage: shardwise" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["check-config", "--help"]])
def test_help_everywhere(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0 and "usage: shardwise" in capsys.readouterr().out


def test_every_subcommand_is_registered_with_a_run_function() -> None:
    parser = build_parser()
    for module in SUBCOMMANDS:
        assert callable(module.add_parser) and callable(module.run)
    assert parser.parse_args(["check-config", "x.json"]).func.__module__ == "shardwise.cli.check_config"


def test_module_entry_point_in_a_subprocess(tmp_path: Path) -> None:
    bad = write(tmp_path, {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                           "gradient_accumulation_steps": 2})
    result = subprocess.run([sys.executable, "-m", "shardwise.cli.main", "check-config", bad, "--world", "4"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert_one_line_error(result.stderr, "train_batch_size 30 != train_micro_batch_size_per_gpu 4 * "
                                         "gradient_accumulation_steps 2 * data-parallel size 4 = 32")


def test_auto_is_filled_from_the_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"}}
    path = write(tmp_path, config)
    assert main(["check-config", path, "--world", "2", "--json"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split('"')[1] for line in lines] == [
        "train_micro_batch_size_per_gpu", "optimizer.params.lr", "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold"]
    assert "--micro-batch" in lines[0] and "--lr" in lines[1] and "--hidden-size" in lines[2]
    argv = ["check-config", path, "--world", "2", "--json", "--hidden-size", "100", "--micro-batch", "3",
            "--lr", "0.01"]
    assert main(argv) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["batch"]["train_batch_size"] == 6 and described["batch"]["micro_batch"] == 3
    assert described["zero"]["reduce_bucket_size"] == 10_000
    assert described["zero"]["stage3_prefetch_bucket_size"] == 9_000
    assert described["zero"]["stage3_param_persistence_threshold"] == 1_000
    assert described["optimizer"]["params"]["lr"] == 0.01 and described["gradient_clipping"] == 1.0


def test_ignored_keys_print_one_warning_line_each(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text = ('{"train_batch_size": 8, "fp8": {}, // Hugging Face\'s\n'
            ' "comms_config": {}, "tensorboard": {"enabled": false},}')
    assert main(["check-config", write(tmp_path, text), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["batch"]["train_batch_size"] == 8
    assert captured.err.strip().splitlines() == [
        'shardwise: warning: unknown key "fp8" ignored (DeepSpeed ignores unknown top-level keys too)',
        'shardwise: warning: unknown key "comms_config" ignored (DeepSpeed ignores unknown top-level keys too)']


# Hugging Face's documented DeepSpeed configs (its DeepSpeed guide's ZeRO-2 and ZeRO-3 examples), "auto" throughout.
_HF_FP16 = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
            "min_loss_scale": 1}
_HF_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
_HF_COMMON = {"fp16": _HF_FP16, "optimizer": _HF_OPTIMIZER, "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "steps_per_print": 2000, "train_batch_size": "auto",
              "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
HF_DOCS_ZERO2 = {**_HF_COMMON,
                 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto"}},
                 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       "allgather_partitions": True, "allgather_bucket_size": 2e8,
                                       "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                                       "contiguous_gradients": True}}
HF_DOCS_ZERO3 = {**_HF_COMMON,
                 "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                   "warmup_num_steps": "auto",
                                                                   "total_num_steps": "auto"}},
                 "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                                       "contiguous_gradients": True, "sub_group_size": 1e9,
                                       "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                       "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                                       "stage3_max_reuse_distance": 1e9,
                                       "stage3_gather_16bit_weights_on_model_save": True}}
TRAINER_FLAGS = ["--micro-batch", "4", "--grad-accum", "2", "--lr", "2e-5", "--betas", "0.9", "0.95", "--eps", "1e-6",
                 "--weight-decay", "0.01", "--warmup-steps", "10", "--total-steps", "100", "--max-grad-norm", "0.5",
                 "--precision", "fp16", "--hidden-size", "64"]


@pytest.mark.parametrize("config", [HF_DOCS_ZERO2, HF_DOCS_ZERO3], ids=["zero2", "zero3"])
def test_hugging_face_documented_configs_pass_once_every_auto_is_given(
        config: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path, config)
    assert main(["check-config", path, "--world", "2", "--json"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and all(re.search(r"--[a-z-]+ to check-config", line) for line in lines), lines
    assert main(["check-config", path, "--world", "2", "--json", *TRAINER_FLAGS]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["batch"]["micro_batch"], d["batch"]["grad_accum"], d["batch"]["train_batch_size"]) == (4, 2, 16)
    assert d["optimizer"]["params"] == {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01}
    params = d["scheduler"]["params"]
    assert (params["warmup_min_lr"], params["warmup_max_lr"], params["warmup_num_steps"]) == (0, 2e-5, 10)
    assert params.get("total_num_steps", 100) == 100
    assert d["gradient_clipping"] == 0.5 and d["precision"]["dtype"] == "fp16"
    if config is HF_DOCS_ZERO3:
        assert (d["zero"]["reduce_bucket_size"], d["zero"]["stage3_prefetch_bucket_size"],
                d["zero"]["stage3_param_persistence_threshold"]) == (64 * 64, int(0.9 * 64 * 64), 10 * 64)
