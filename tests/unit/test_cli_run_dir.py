"""`shardwise train` into a directory that already holds a run: start, resume or refuse (no processes), the
launcher's few lines for failed ranks, the metrics history of a resumed run, and the random streams a
checkpoint carries."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shardwise.cli.rank_reports import CRASH, USER, ProcessExit, RankReport, failure_lines, read_reports, write_failure
from shardwise.cli.run_dir import decide, identity_difference, lock
from shardwise.errors import UserError
from shardwise.telemetry import final_history

ARGS = {"config": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "train_micro_batch_size_per_gpu": 2},
        "model": "tiny", "seq_len": 32, "data": "stdlib", "steps": 10, "seed": 0, "out": "/x"}


def _earlier_run(run_dir: Path, *, latest: str | None = "global_step4", args: dict = ARGS) -> Path:
    run_dir.mkdir()
    (run_dir / "train_args.json").write_text(json.dumps(args))
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    if latest is not None:
        (run_dir / "checkpoints" / latest).mkdir(parents=True)
        (run_dir / "checkpoints" / "latest").write_text(latest)
    return run_dir


def _decide(run_dir: Path, now: dict = ARGS, **flags: bool):
    return decide(run_dir, "train_args.json", now, resume=flags.get("resume", False),
                  overwrite=flags.get("overwrite", False))


def test_fresh_directory_starts_and_resume_needs_a_checkpoint(tmp_path: Path) -> None:
    assert _decide(tmp_path / "new").resume_step is None
    with pytest.raises(UserError, match="holds no checkpoint to resume from"):
        _decide(tmp_path / "new", resume=True)
    # Only the arguments of a launch that failed before its first step: nothing to keep, so it starts.
    (tmp_path / "failed").mkdir()
    (tmp_path / "failed" / "train_args.json").write_text(json.dumps({**ARGS, "seed": 7}))
    assert _decide(tmp_path / "failed").message is None


def test_the_same_run_resumes_automatically_and_may_grow_its_steps(tmp_path: Path) -> None:
    run = _earlier_run(tmp_path / "run")
    for flags in ({}, {"resume": True}):
        decision = _decide(run, {**ARGS, "steps": 20}, **flags)
        assert decision.resume_step == 4
        assert decision.message == f"resuming {run} from checkpoint global_step4 (the same run: metrics.jsonl is " \
                                   f"appended to)"
    with pytest.raises(UserError, match=r"has trained 4 steps already .* --steps 4 is done"):
        _decide(run, {**ARGS, "steps": 4})


@pytest.mark.parametrize("change, named", [
    ({"seed": 1}, "seed: 0 there, 1 now"),
    ({"model": "small"}, 'model: "tiny" there, "small" now'),
    ({"config": {**ARGS["config"], "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}}},
     "config.optimizer.params.lr: 0.001 there, 0.002 now"),
    ({"data": "other.txt"}, 'data: "stdlib" there, "other.txt" now'),
    ({"vocab_size": 512}, "vocab_size: null there, 512 now"),
    ({"config": {**ARGS["config"], "bf16": {"enabled": True}}}, "config.bf16 (only now)"),
    ({"config": {**ARGS["config"], "zero_optimization": {"stage": 3, "zero_quantized_weights": True}}},
     "config.zero_optimization (only now)"),
    ({"config": {**ARGS["config"], "gradient_clipping": 1.0}}, "config.gradient_clipping (only now)"),
])
def test_another_run_is_refused_in_one_line_naming_the_difference(tmp_path: Path, change: dict, named: str) -> None:
    run = _earlier_run(tmp_path / "run")
    before = sorted(p.name for p in run.rglob("*"))
    with pytest.raises(UserError) as info:
        _decide(run, {**ARGS, **change})
    message = str(info.value)
    assert "\n" not in message and named in message and "--overwrite" in message, message
    assert sorted(p.name for p in run.rglob("*")) == before         # nothing touched
    assert identity_difference(ARGS, {**ARGS, "steps": 99, "out": "/elsewhere"}) is None


def test_the_same_run_without_a_checkpoint_is_refused_and_overwrite_replaces_it(tmp_path: Path) -> None:
    run = _earlier_run(tmp_path / "run", latest=None)
    with pytest.raises(UserError, match="without a checkpoint to resume from"):
        _decide(run)
    (run / "logs").mkdir()
    with pytest.raises(UserError, match="contradict"):
        _decide(run, resume=True, overwrite=True)
    decision = _decide(run, {**ARGS, "seed": 3}, overwrite=True)
    assert decision.resume_step is None and "removed the earlier run's metrics.jsonl" in decision.message
    assert sorted(p.name for p in run.iterdir()) == ["logs", "train_args.json"]


def test_one_command_at_a_time_trains_into_a_directory(tmp_path: Path) -> None:
    held = lock(tmp_path, ".train_args.lock")
    with pytest.raises(UserError, match=r"is in use by another shardwise train \(pid \d+\)"):
        lock(tmp_path, ".train_args.lock")
    lock(tmp_path, ".train_args.node1.lock").close()       # another node's launcher sharing the directory
    held.close()
    lock(tmp_path, ".train_args.lock").close()


def test_failure_lines_user_error_wins_then_killed_ranks_then_crashes(tmp_path: Path) -> None:
    try:
        raise RuntimeError("boom\nsecond line of the message")
    except RuntimeError as e:
        crash = write_failure(tmp_path, rank=0, attempt=0, error=e)
    assert crash.kind == CRASH and crash.message == "RuntimeError: second line of the message"
    assert "Traceback" in Path(crash.log).read_text() and "boom" in Path(crash.log).read_text()
    assert read_reports(tmp_path) == [crash]

    killed = {1: ProcessExit(exitcode=-signal.SIGKILL, pid=42)}
    code, lines = failure_lines([crash], killed, tmp_path)
    assert code == 1
    assert lines == ["shardwise: rank 1 was killed by SIGKILL (pid 42)",
                     f"shardwise: rank 0 failed: RuntimeError: second line of the message (traceback: {crash.log})"]

    user = RankReport(rank=3, attempt=0, kind=USER, message="2 stages x 4 virtual stages: too many", time=0.0)
    assert failure_lines([crash, user], killed, tmp_path) == (2, ["shardwise: error: 2 stages x 4 virtual stages: "
                                                                  "too many"])
    many = {r: ProcessExit(exitcode=1, pid=r) for r in range(6)}
    code, lines = failure_lines([], many, tmp_path)
    assert len(lines) == 4 and lines[-1].startswith("shardwise: 3 more rank(s) failed")


def test_reports_of_an_earlier_attempt_are_not_read(tmp_path: Path) -> None:
    for attempt in (0, 1):
        try:
            raise ValueError(f"attempt {attempt}")
        except ValueError as e:
            write_failure(tmp_path, rank=attempt, attempt=attempt, error=e)
    assert [r.message for r in read_reports(tmp_path)] == ["ValueError: attempt 1"]


def test_final_history_drops_the_steps_a_restart_redid() -> None:
    rows = [{"step": s, "loss": float(s)} for s in (1, 2, 3)] + [{"step": s, "loss": s + 0.5} for s in (3, 4)]
    assert [(r["step"], r["loss"]) for r in final_history(rows)] == [(1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5)]


def test_random_streams_round_trip_with_tensor_parallel_dropout_streams() -> None:
    from shardwise.cli.resume import rng_state, set_rng_state
    from shardwise.parallel.tensor_parallel.random import TP_RNG_ATTR

    stream = SimpleNamespace(local_state=torch.Generator().manual_seed(5).get_state())
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    setattr(module[1], TP_RNG_ATTR, stream)
    engine = SimpleNamespace(device=torch.device("cpu"), module=module)

    def draws() -> tuple:
        return torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()

    saved = rng_state(engine)
    first = draws()
    stream.local_state = torch.Generator().manual_seed(6).get_state()
    set_rng_state(engine, saved)
    assert draws() == first
    assert torch.equal(stream.local_state, saved["tp_streams"][0])


def test_train_into_another_runs_directory_is_one_line_exit_2_and_touches_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardwise.cli.main import main

    run = _earlier_run(tmp_path / "run", args={**ARGS, "data": "stdlib", "seq_len": 128})
    def files() -> dict:          # (the lock file of the refused command aside)
        return {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and not p.name.endswith(".lock")}

    before = files()
    assert main(["train", "--nproc", "2", "--seed", "1", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"shardwise: error: --out {run} holds another run (different "
                                                   f"seed: 0 there, 1 now)"), err
    assert files() == before


def _default_run(steps: int, **config: object) -> dict:
    from shardwise.cli.train import default_config
    return {**ARGS, "config": {**default_config(steps), **config}, "steps": steps, "train_batch_size": 8}


def test_a_longer_run_resumes_with_its_schedule_recomputed_and_said_in_one_line(tmp_path: Path) -> None:
    from shardwise.cli.resume import schedule_note

    run = _earlier_run(tmp_path / "run", latest="global_step10", args=_default_run(10))
    decision = decide(run, "train_args.json", _default_run(200), resume=False, overwrite=False,
                      schedule_note=schedule_note)
    assert decision.resume_step == 10
    # WarmupLR over 20 steps (a tenth of the new run): step 11 is at iteration 9 of the ramp, 9/20 of the peak
    assert decision.notes == ("--steps 10 -> 200: the schedule is recomputed (warmup 1 -> 20 steps); step 11 trains "
                              "at lr 0.00045 where the old schedule gave 0.001",)
    # the same config with another warm-up and the same --steps is a changed config: refused, naming it
    changed = _default_run(10)
    changed["config"]["scheduler"]["params"]["warmup_num_steps"] = 5
    with pytest.raises(UserError, match=r"different config.scheduler.params.warmup_num_steps: 1 there, 5 now"):
        _decide(run, changed)
    # a longer run whose schedule changes otherwise (its peak) is refused too
    other = _default_run(200)
    other["config"]["scheduler"]["params"]["warmup_max_lr"] = 3e-3
    with pytest.raises(UserError, match=r"different config.scheduler.params.warmup_max_lr: 0.001 there, 0.003 now"):
        _decide(run, other)


@pytest.mark.parametrize("layout", [
    {"zero_optimization": {"stage": 3}},
    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    {"tensor_parallel": {"size": 2}},
    {"pipeline": {"stages": 2, "schedule": "1f1b"}},
    {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
    {"activation_checkpointing": {"policy": "full"}, "communication": {"all_reduce": "ring"}},
])
def test_a_run_resumes_at_another_layout_and_says_what_changed(tmp_path: Path, layout: dict) -> None:
    run = _earlier_run(tmp_path / "run", latest="global_step4", args=_default_run(10))
    decision = _decide(run, _default_run(10, **layout))           # the global batch kept: 8 sequences
    assert decision.resume_step == 4
    assert len(decision.notes) == 1 and decision.notes[0].startswith("at another layout than the checkpoint's")
    first = next(iter(layout))
    assert first in decision.notes[0], decision.notes


def test_another_global_batch_resumes_with_a_note(tmp_path: Path) -> None:
    run = _earlier_run(tmp_path / "run", latest="global_step4", args=_default_run(10))
    decision = _decide(run, {**_default_run(10), "train_batch_size": 16})     # two ranks where there was one
    assert decision.notes == ("the global batch changes from 8 to 16 sequences per step: the steps from here each "
                              "train on 16, so the run's later losses are not those of a run at 8",)
    assert _decide(run, _default_run(10)).notes == ()


def test_the_expert_parallel_size_is_layout_a_run_resumes_across() -> None:
    # a checkpoint with experts loads at another ep size, so changing it keeps the same run
    from shardwise.cli.run_dir import what_matters
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert what_matters({**base, "expert_parallel": {"size": 2}}) == what_matters(base)
    assert what_matters({**base, "expert_parallel": {"size": 2}}) != what_matters({**base, "gradient_clipping": 0.5})
