"""`shardwise train` end to end: ranks launched by torchrun, metrics/plot/summary written, two nodes on
localhost, and user errors reported as one line with exit code 2 before anything is launched."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.cli.train import threads_per_rank
from shardwise.telemetry import read_metrics
from shardwise.telemetry.metrics import format_rate

TRAIN = [sys.executable, "-m", "shardwise.cli.main", "train"]


def _env() -> dict[str, str]:
    # One thread per rank: this machine's cores are shared by every test running.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _small_text_corpus(path: Path, n_bytes: int = 200_000) -> Path:
    """A few hundred KB of stdlib source: byte-level text like 'stdlib', quicker for every rank to read."""
    parts, total = [], 0
    for name in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = name.read_bytes()
        parts.append(data)
        total += len(data)
        if total >= n_bytes:
            break
    path.write_bytes(b"\n".join(parts)[:n_bytes])
    return path


def test_two_ranks_on_stdlib_write_metrics_plot_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "run"
    steps = 12
    proc = subprocess.run(TRAIN + ["--nproc", "2", "--model", "tiny", "--data", "stdlib", "--steps", str(steps),
                                   "--seq-len", "64", "--out", str(out)],
                          env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr

    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["tokens"] == 8 * 2 * 64 for r in rows)           # default micro-batch 8, 2 ranks, seq 64
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in rows)   # (no upper bound: a noisy peak)
    losses = [r["loss"] for r in rows]
    assert abs(losses[0] - 5.545) < 0.3                           # ~ln(256): an untrained byte model
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses         # decreasing-ish
    # gradient_clipping defaults to 1.0, so every step measured the norm; fp32 neither scales nor skips.
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)
    assert all(r["loss_scale"] == 1.0 and r["skipped_steps"] == 0 for r in rows)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["world_size"] == 2
    assert summary["final_loss"] == pytest.approx(losses[-1])
    assert summary["final_grad_norm"] == rows[-1]["grad_norm"] and summary["skipped_steps"] == 0
    assert len(summary["memory_per_rank"]) == 2
    assert all(m["peak_rss"] > 0 and m["params"] > 0 for m in summary["memory_per_rank"])
    assert summary["comm_bytes_per_step"] > 0                     # the gradient all-reduce
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "train_args.json").read_text())["seq_len"] == 64

    # Output is not a terminal here: plain progress lines, then the summary table.
    assert "step 1/12 | loss" in proc.stdout and "step 12/12 | loss" in proc.stdout
    # one line per interval of steps_per_print (10), not the engine's DeepSpeed-style lines besides
    progress = [line for line in proc.stdout.splitlines() if line.startswith(("step ", "steps: ", "[Rank 0] step="))]
    assert [line.split(" |")[0] for line in progress] == ["step 1/12", "step 10/12", "step 12/12"], progress
    # the last line's throughput is that of steps 11-12, as metrics.jsonl has them
    rate = sum(r["tokens"] for r in rows[10:]) / sum(r["step_time_s"] for r in rows[10:])
    assert f"| {format_rate(rate)} tok/s |" in progress[-1] and "(steps 11-12)" in progress[-1], progress[-1]
    assert "Training summary" in proc.stdout and "Memory per rank" in proc.stdout
    assert "final gradient norm" in proc.stdout and "skipped steps" in proc.stdout


@pytest.mark.slow      # four Python processes start torch on two launchers: 20-40 s on a shared 2-core box
def test_two_nodes_on_localhost(tmp_path: Path) -> None:
    corpus = _small_text_corpus(tmp_path / "corpus.txt")
    port = str(_free_port())
    common = ["--nnodes", "2", "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port", port,
              "--data", str(corpus), "--steps", "3", "--seq-len", "64", "--peak-tflops", "0.1",
              "--out", str(tmp_path / "run"), "--save-every", "3"]
    nodes = [subprocess.Popen(TRAIN + common + ["--node-rank", str(r)], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (1, 0)]   # either may start first
    try:
        outputs = [p.communicate(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(nodes, outputs):
        assert p.returncode == 0, stdout + stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert summary["peak_flops"] == pytest.approx(2 * 0.1e12)      # --peak-tflops is per rank
    assert {"train_args.node0.json", "train_args.node1.json"} <= {f.name for f in (tmp_path / "run").iterdir()}
    assert (tmp_path / "run" / "checkpoints").is_dir()
    assert "Training summary" in outputs[1][0] and "Training summary" not in outputs[0][0]   # global rank 0
    # Node 0 said what it waited for; each node wrote its own log and summary row and printed the row.
    assert f"waiting for 1 more node at 127.0.0.1:{port}" in outputs[1][0]
    for node, (stdout, _) in zip((1, 0), outputs):
        row = json.loads((tmp_path / "run" / f"node{node}.json").read_text())
        assert (row["node_rank"], row["nnodes"], row["global_ranks"], row["local_ranks"], row["steps"]) == \
            (node, 2, [node], [0], 3)
        assert row["final_loss"] == pytest.approx(summary["final_loss"]) and row["peak_rss_bytes"][0] > 0
        log = (tmp_path / "run" / f"node{node}.log").read_text()
        assert f"node {node} of 2" in log and "step 3/3" in log
        assert f"node {node} (" in stdout and f"node{node}.json" in stdout


# -- user errors: one line, exit 2, nothing launched ------------------------------------------------
def _config(tmp_path: Path, name: str, body: dict | str) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return str(path)


_OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3}}


@pytest.mark.parametrize("case, expected", [
    ("bad_preset", "unknown GPT preset 'tinyy'"),
    ("missing_corpus", "no such file or directory"),
    ("short_corpus", "needs at least 65"),
    ("bad_config_key", 'did you mean "zero_optimization"'),
    ("batch_arithmetic", "train_batch_size"),
    ("missing_config", "cannot read config file"),
    ("invalid_json", "is not valid JSON"),
    ("zero_steps", "--steps 0: must be at least 1"),
    ("node_rank", "--node-rank 2: must be in 0..1"),
    ("no_master_addr", "needs --master-addr"),
    ("trace_without_pipeline", "--pipeline-trace needs a pipeline"),
    ("negative_restarts", "--max-restarts -1: must be 0 or more"),
    ("restarts_on_two_nodes", "--max-restarts 1 with --nnodes 2"),
    ("context_parallel_seq_len", "seq_len 30 does not cut into 2 * context_parallel.size = 4 chunks"),
    ("context_parallel_flags", "seq_len 30 does not cut into 2 * context_parallel.size = 4 chunks"),
    ("context_parallel_flag", "--context-parallel 0: must be at least 1"),
    ("expert_parallel_dense_model", "--model tiny: expert_parallel.size = 2 needs a model with MoE layers"),
    ("expert_parallel_not_dividing_dp", '"expert_parallel.size" = 4 does not divide the data-parallel size 2'),
    ("expert_parallel_not_dividing_experts", "its 4 experts per layer do not split over expert_parallel.size = 8"),
    ("expert_parallel_flag", "--expert-parallel 0: must be at least 1"),
])
def test_user_errors_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str,
                                          expected: str) -> None:
    out = tmp_path / "run"
    short = tmp_path / "short.txt"
    short.write_text("too short")
    argv = {
        "bad_preset": ["--model", "tinyy"],
        "missing_corpus": ["--data", str(tmp_path / "nope.txt")],
        "short_corpus": ["--data", str(short), "--seq-len", "64"],
        "bad_config_key": [_config(tmp_path, "typo", {"train_micro_batch_size_per_gpu": 4, "optimizer": _OPTIMIZER,
                                              "zero_optimisation": {"stage": 0}})],
        "batch_arithmetic": [_config(tmp_path, "batch", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                                                "gradient_accumulation_steps": 1, "optimizer": _OPTIMIZER})],
        "missing_config": [str(tmp_path / "missing.json")],
        "invalid_json": [_config(tmp_path, "invalid", '{"train_batch_size": 8,,}')],   # hjson takes one trailing comma
        "zero_steps": ["--steps", "0"],
        "node_rank": ["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"],
        "no_master_addr": ["--nnodes", "2"],
        "trace_without_pipeline": ["--pipeline-trace"],
        "negative_restarts": ["--max-restarts", "-1"],
        "restarts_on_two_nodes": ["--nnodes", "2", "--master-addr", "127.0.0.1", "--max-restarts", "1"],
        "context_parallel_seq_len": [_config(tmp_path, "cp", {"train_micro_batch_size_per_gpu": 4,
                                                              "optimizer": _OPTIMIZER, "context_parallel": {"size": 2}}),
                                     "--seq-len", "30"],
        "context_parallel_flags": ["--context-parallel", "2", "--cp-impl", "ring", "--seq-len", "30"],
        "context_parallel_flag": ["--context-parallel", "0"],
        "expert_parallel_dense_model": ["--expert-parallel", "2"],
        "expert_parallel_not_dividing_dp": ["--model", "gpt-moe-tiny", "--expert-parallel", "4"],
        # a config whose AutoEP block the flag overrides; 8 ranks divide dp 8 but not the 4 experts
        "expert_parallel_not_dividing_experts": [_config(tmp_path, "ep", {"train_micro_batch_size_per_gpu": 1,
                                                                          "optimizer": _OPTIMIZER, "expert_parallel":
                                                                          {"enabled": True, "autoep_size": 2}}),
                                                 "--model", "gpt-moe-tiny", "--expert-parallel", "8", "--nproc", "8"],
        "expert_parallel_flag": ["--expert-parallel", "0"],
    }[case]
    code = main(["train", "--nproc", "2", "--steps", "5", "--out", str(out), *argv])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardwise: error: "), captured.err
    assert expected in lines[0], lines[0]
    assert captured.out == ""
    assert not out.exists()                  # validated before anything was created or launched


def test_user_error_as_a_real_process_has_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(TRAIN + ["--nproc", "2", "--model", "gpt5", "--out", str(tmp_path / "run")],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("shardwise: error: --model 'gpt5': unknown GPT preset")


def test_threads_per_rank_splits_the_cores() -> None:
    cores = len(os.sched_getaffinity(0))
    assert threads_per_rank(1) == cores
    assert threads_per_rank(cores * 4) == 1
    assert threads_per_rank(2) == max(1, cores // 2)


def test_launcher_command_single_node_standalone_and_multi_node_static(tmp_path: Path) -> None:
    from shardwise.cli.launch import STOP_GRACE_S
    from shardwise.cli.main import build_parser
    from shardwise.cli.train import launcher_command

    args_path = tmp_path / "train_args.json"
    one = launcher_command(build_parser().parse_args(["train", "--nproc", "3"]), args_path)
    assert one[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in one and one[one.index("--nproc-per-node") + 1] == "3"
    assert one[-3:] == ["-m", "shardwise.cli.train_worker", str(args_path)]

    assert one[one.index("--max-restarts") + 1] == "0"
    restarts = launcher_command(build_parser().parse_args(["train", "--max-restarts", "3"]), args_path)
    assert restarts[restarts.index("--max-restarts") + 1] == "3"

    two = launcher_command(build_parser().parse_args(
        ["train", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "1234"]),
        args_path)
    assert "--standalone" not in two
    flags = dict(zip(two[3:-3:2], two[4:-3:2]))
    grace = {} if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ else {"--shutdown-timeout": str(STOP_GRACE_S)}
    assert flags == {"--nproc-per-node": "1", "--nnodes": "2", "--max-restarts": "0", "--rdzv-backend": "static",
                     "--node-rank": "1", "--master-addr": "10.0.0.1", "--master-port": "1234", **grace}


def test_pipeline_run_draws_its_measured_timeline(tmp_path: Path) -> None:
    config = _config(tmp_path, "pp", {"train_batch_size": 8, "gradient_accumulation_steps": 4, "optimizer": _OPTIMIZER,
                                      "pipeline": {"stages": 2, "schedule": "1f1b"}})
    out = tmp_path / "run"
    proc = subprocess.run(TRAIN + [config, "--nproc", "2", "--model", "tiny", "--steps", "2", "--seq-len", "32",
                                   "--out", str(out), "--pipeline-trace"],
                          env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = json.loads((out / "pipeline_trace.json").read_text())
    actions = sorted((r["stage"], r["action"]) for r in trace["records"])
    # 1F1B on 2 stages with 4 micro-batches: every stage runs F0..F3 and B0..B3 once
    assert actions == sorted((s, f"{op}{m}") for s in (0, 1) for op in "FB" for m in range(4))
    assert 0.0 < trace["bubble_fraction"] < 1.0
    assert (out / "pipeline_timeline.png").stat().st_size > 0
    assert "measured bubble fraction" in proc.stdout
