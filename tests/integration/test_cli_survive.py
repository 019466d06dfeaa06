"""Runs of `shardwise train` that survive: resumed at every layout bitwise equal to the uninterrupted run (context
parallelism among them), a checkpoint resumed at another context-parallel size, a
rank killed and the ranks restarted, SIGTERM and SIGINT stopping the ranks with a checkpoint, and failures
inside the ranks reported in one line (user errors, exit 2) or a few (a killed rank).

The layout matrix runs the ranks' own `train` in one 2-rank launch (cheaper than a launch per case); the
rest launch `shardwise train` as a user does, with a time bound on every process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.telemetry import final_history, read_metrics
from shardwise.testing import run_distributed

TRAIN = [sys.executable, "-m", "shardwise.cli.main", "train"]
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                      "warmup_num_steps": 3}}}
LAYOUTS = {          # 2 ranks each: name -> (config block, steps, step of the checkpoint resumed from)
    "dp": ({}, 14, 12),                       # also the uninterrupted reference of the command-line runs
    "zero1": ({"zero_optimization": {"stage": 1}}, 4, 2),
    "zero2": ({"zero_optimization": {"stage": 2}}, 4, 2),
    "zero3": ({"zero_optimization": {"stage": 3}}, 4, 2),
    "tp": ({"tensor_parallel": {"size": 2}}, 4, 2),
    "pp": ({"pipeline": {"stages": 2, "schedule": "1f1b"}}, 4, 2),
    "cp": ({"context_parallel": {"size": 2}}, 4, 2),       # dp 1: every rank reads the same windows, half of each
}
SEQ_LEN = 32


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _corpus(path: Path) -> Path:
    """100 KB of Python source: byte-level text, quick for every rank to read."""
    text = Path(json.__file__).read_text() * 40
    path.write_text(text[:100_000])
    return path


def _worker_args(out: Path, corpus: Path, block: dict, steps: int, save_every: int):
    from shardwise.cli.train import WorkerArgs

    return WorkerArgs(config={**BASE, **block}, model="tiny", seq_len=SEQ_LEN, data=str(corpus), steps=steps, seed=0,
                      out=str(out), peak_tflops=0.1, save_every=save_every, steps_per_print=100, launch="test")


def _interrupted_copy(full: Path, resumed: Path, step: int) -> None:
    """What a run stopped after `step` leaves: its checkpoint of that step as `latest`, its metrics up to it."""
    tag = f"global_step{step}"
    shutil.copytree(full / "checkpoints" / tag, resumed / "checkpoints" / tag)
    (resumed / "checkpoints" / "latest").write_text(tag)
    rows = (full / "metrics.jsonl").read_text().splitlines(keepends=True)[:step]
    (resumed / "metrics.jsonl").write_text("".join(rows))


def _matrix(root: str, corpus: str) -> dict:
    """Every layout: the uninterrupted run, then one resumed from its checkpoint half-way (rank 0 reads both)."""
    import torch.distributed as dist

    from shardwise.cli.train_worker import train

    out: dict = {}
    for name, (block, steps, half) in LAYOUTS.items():
        full, resumed = Path(root) / f"{name}-full", Path(root) / f"{name}-resumed"
        train(_worker_args(full, Path(corpus), block, steps, save_every=2))
        if dist.get_rank() == 0:
            _interrupted_copy(full, resumed, half)
        dist.barrier()
        train(_worker_args(resumed, Path(corpus), block, steps, save_every=2))
        if dist.get_rank() == 0:
            out[name] = (read_metrics(full / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl"))
    # Another cp size: TP 2's checkpoint of step 2 (cp 1, dp 1) resumed at cp 2 (dp 1: the same windows).
    at_cp2 = Path(root) / "tp-resumed-at-cp2"
    if dist.get_rank() == 0:
        _interrupted_copy(Path(root) / "tp-full", at_cp2, LAYOUTS["tp"][2])
    dist.barrier()
    train(_worker_args(at_cp2, Path(corpus), LAYOUTS["cp"][0], LAYOUTS["tp"][1], save_every=2))
    if dist.get_rank() == 0:
        out["tp-resumed-at-cp2"] = read_metrics(at_cp2 / "metrics.jsonl")
    # Extended and re-laid-out: 4 steps at dp 2 with a 2-step warm-up, then resumed to 8 steps with an 8-step
    # warm-up at TP 2 x ZeRO-1 (dp 1: twice the accumulation keeps the global batch of 8 sequences).
    extended = Path(root) / "extended"
    train(_worker_args(extended, Path(corpus), {"scheduler": _warmup(2)}, 4, save_every=4))
    train(_worker_args(extended, Path(corpus), {"scheduler": _warmup(8), "gradient_accumulation_steps": 4,
                                               "tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 1}},
                       8, save_every=4))
    if dist.get_rank() == 0:
        out["extended"] = read_metrics(extended / "metrics.jsonl")
    return out


def _warmup(steps: int) -> dict:
    return {"type": "WarmupLR", "params": {**BASE["scheduler"]["params"], "warmup_num_steps": steps,
                                           "warmup_type": "linear"}}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("matrix")
    corpus = _corpus(root / "corpus.txt")
    return corpus, run_distributed(_matrix, world_size=2, args=(str(root), str(corpus)), timeout=600)[0]


def _same_steps(a: list[dict], b: list[dict]) -> None:
    """Bitwise: the same loss, learning rate and gradient norm at every step."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert (x["loss"], x["lr"], x["grad_norm"]) == (y["loss"], y["lr"], y["grad_norm"]), (x, y)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resume_continues_bitwise_at_every_layout(matrix: tuple[Path, dict], layout: str) -> None:
    full, resumed = matrix[1][layout]
    steps, half = LAYOUTS[layout][1], LAYOUTS[layout][2]
    assert [r["step"] for r in full] == list(range(1, steps + 1))
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))   # appended: nothing redone or truncated
    assert resumed[:half] == full[:half]
    _same_steps(resumed[half:], full[half:])
    assert resumed[-1]["elapsed_s"] > resumed[half - 1]["elapsed_s"]    # the clock continues


def test_a_run_resumes_at_another_context_parallel_size(matrix: tuple[Path, dict]) -> None:
    """cp changes nothing saved: TP 2's checkpoint resumed at cp 2 trains on as TP 2 did (fp32: the same
    arithmetic in another order, so within fp32 rounding, not bitwise)."""
    full, resumed = matrix[1]["tp"][0], matrix[1]["tp-resumed-at-cp2"]
    half = LAYOUTS["tp"][2]
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for x, y in zip(resumed[half:], full[half:]):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and x["lr"] == y["lr"], (x, y)


def test_an_extended_run_resumes_at_another_layout_on_the_new_schedule(matrix: tuple[Path, dict]) -> None:
    rows = matrix[1]["extended"]
    assert [r["step"] for r in rows] == list(range(1, 9))
    # WarmupLR: step s trains at iteration s - 2 of the ramp; from step 5 on, the 8-step ramp of the new config
    # (the checkpoint carries the 2-step one, which would give 1e-3)
    assert [r["lr"] for r in rows[4:]] == [1e-3 * (it / 8) for it in (3, 4, 5, 6)]
    assert [r["lr"] for r in rows[:4]] == [0.0, 0.0, 5e-4, 1e-3]
    assert all(r["loss"] < rows[0]["loss"] for r in rows[4:])       # it goes on from the trained weights


def _launch(args: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(TRAIN + args, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _signal_after(proc: subprocess.Popen, metrics: Path, rows: int, sig: int, timeout: float = 240) -> None:
    """Send `sig` once `metrics` has `rows` lines (bounded in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows:
            proc.send_signal(sig)
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {rows} metrics rows within {timeout} s: {proc.communicate()}")


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def test_killed_rank_restarts_then_sigterm_and_sigint_stop_with_a_checkpoint_and_resume(
        matrix: tuple[Path, dict], tmp_path: Path, kill_rank_after_step) -> None:
    corpus, results = matrix
    config = tmp_path / "dp.json"
    config.write_text(json.dumps(BASE))
    out = tmp_path / "run"
    steps = LAYOUTS["dp"][1]
    command = [str(config), "--nproc", "2", "--model", "tiny", "--data", str(corpus), "--seq-len", str(SEQ_LEN),
               "--steps", str(steps), "--peak-tflops", "0.1", "--save-every", "2", "--max-restarts", "1",
               "--out", str(out)]
    metrics = out / "metrics.jsonl"

    # Rank 1 dies (SIGKILL) after step 3 on the first attempt; the restarted ranks resume from step 2 and redo
    # step 3. Once they are past it, SIGTERM: the ranks finish their step, save it and stop; exit 143.
    proc = _launch(command, **kill_rank_after_step(rank=1, step=3))
    _signal_after(proc, metrics, 5, signal.SIGTERM)
    code, stdout, stderr = _finish(proc)
    assert code == 143, stdout[-2000:] + stderr[-3000:]
    assert "attempt 2: resumed from" in stdout and "at step 2" in stdout
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    stopped = int(stderr.split("stopped after step ")[1].split()[0])
    assert (out / "checkpoints" / "latest").read_text() == f"global_step{stopped}"
    rows = read_metrics(metrics)
    # The dead attempt's row of step 3 is set aside (every step appears once); the redone step is the same step.
    dead = read_metrics(out / "metrics.dropped.jsonl")
    assert [r["step"] for r in rows][:4] == [1, 2, 3, 4] and [r["step"] for r in dead] == [3]
    assert dead[0] == {**rows[2], "step_time_s": dead[0]["step_time_s"], "tokens_per_s": dead[0]["tokens_per_s"],
                       "mfu": dead[0]["mfu"], "elapsed_s": dead[0]["elapsed_s"], "rss_bytes": dead[0]["rss_bytes"]}
    assert rows[-1]["step"] == stopped < steps

    # The same command resumes by itself (one line says so); SIGINT (Ctrl-C) stops it the same way: exit 130.
    proc = _launch(command)
    _signal_after(proc, metrics, len(rows) + 1, signal.SIGINT)
    code, stdout, stderr = _finish(proc)
    assert code == 130, stdout[-2000:] + stderr[-3000:]
    assert f"resuming {out} from checkpoint global_step{stopped}" in stdout
    assert "SIGINT: stopped after step" in stderr and "Traceback" not in stderr

    code, stdout, stderr = _finish(_launch(command))
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    history = final_history(read_metrics(metrics))
    _same_steps(history, results["dp"][0])            # the uninterrupted run of the same arguments
    assert json.loads((out / "summary.json").read_text())["final_loss"] == results["dp"][0][-1]["loss"]


def test_kill_9_of_a_rank_prints_a_few_lines(matrix: tuple[Path, dict], tmp_path: Path, kill_rank_after_step) -> None:
    corpus = matrix[0]
    out = tmp_path / "run"
    code, stdout, stderr = _finish(_launch(["--nproc", "2", "--data", str(corpus), "--seq-len", str(SEQ_LEN),
                                            "--steps", "3", "--peak-tflops", "0.1", "--out", str(out)],
                                           **kill_rank_after_step(rank=1, step=1)))
    assert code == 1, stdout[-2000:] + stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert 1 <= len(lines) <= 3 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("shardwise: rank 1 was killed by SIGKILL (pid ")
    for line in lines[1:]:            # rank 0 lost its peer: its traceback is in the run directory
        assert line.startswith("shardwise: rank 0 failed: ") and "traceback: " in line
        assert Path(line.split("traceback: ")[1].rstrip(")")).read_text().startswith("Traceback")


def test_user_error_inside_the_ranks_is_one_line_and_exit_2(matrix: tuple[Path, dict], tmp_path: Path) -> None:
    config = tmp_path / "pp.json"      # valid JSON and batch arithmetic; the ranks find the model too short
    config.write_text(json.dumps({**BASE, "gradient_accumulation_steps": 4,
                                  "pipeline": {"stages": 2, "virtual_stages": 4, "schedule": "interleaved_1f1b"}}))
    code, stdout, stderr = _finish(_launch([str(config), "--nproc", "2", "--data", str(matrix[0]), "--seq-len",
                                            str(SEQ_LEN), "--steps", "2", "--out", str(tmp_path / "run")]))
    assert code == 2, stdout[-2000:] + stderr[-3000:]
    assert stderr.splitlines() == ["shardwise: error: 2 stages x 4 virtual stages = 8 model chunks, but the model has "
                                   "4 layer(s): every chunk needs a layer; lower virtual_stages to at most 2"]
