"""`shardwise train` never starts over beside checkpoints: a `latest` naming a missing or damaged tag, an
unreadable `latest`, or tags without `latest` are refused in one line naming the file and offering the previous
complete tag; `--resume-from TAG` resumes there. On resume the metrics rows after the resumed step are set aside
in metrics.dropped.jsonl (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint.index import INDEX, CheckpointIndex, Dims, sealed
from shardwise.cli.resume import tag_problem
from shardwise.cli.rank_reports import read_reports
from shardwise.cli.run_dir import decide
from shardwise.errors import UserError
from shardwise.telemetry import read_metrics
from shardwise.telemetry.metrics import drop_rows_after

ARGS = {"config": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "train_micro_batch_size_per_gpu": 2},
        "model": "tiny", "seq_len": 32, "data": "stdlib", "steps": 10, "seed": 0, "out": "/x"}
LAYOUT = CheckpointIndex(dims=Dims(dp=1, tp=1, pp=1), tensors={}, module={}, entries=(), fragments={})


def _run(run_dir: Path, tags: tuple[int, ...] = (2, 4, 6)) -> Path:
    """A run directory with real (small) tags, `latest` naming the last."""
    run_dir.mkdir()
    (run_dir / "train_args.json").write_text(json.dumps(ARGS))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n"
                                                   for s in range(1, max(tags) + 2)))
    for step in tags:
        ckpt.write_tag(run_dir / "checkpoints", f"global_step{step}",
                       {ckpt.MODEL_STATES: {"module": {"w": torch.full((256,), float(step))}},
                        ckpt.optim_states_name(0): {"optimizer_state_dict": {"m": torch.zeros(512)}}},
                       seal=lambda sums: {INDEX: sealed(LAYOUT, sums)})
    return run_dir


def _decide(run_dir: Path, **flags):
    return decide(run_dir, "train_args.json", ARGS, resume=False, overwrite=flags.pop("overwrite", False),
                  tag_problem=tag_problem, **flags)


def _refused(run_dir: Path, *, named: Path, offered: str | None, **flags) -> str:
    with pytest.raises(UserError) as error:
        _decide(run_dir, **flags)
    line = str(error.value)
    assert "\n" not in line and str(named) in line, line
    if offered is None:
        assert "--resume-from" not in line and "--overwrite" in line, line
    else:
        assert f"--resume-from {offered}" in line, line
    return line


def test_a_whole_latest_resumes(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    assert _decide(run).resume_step == 6


@pytest.mark.parametrize("damage", ["tag deleted", "shard deleted", "shard cut", "index cut", "model states deleted"])
def test_a_damaged_latest_is_refused_naming_the_file_and_offering_the_previous_whole_tag(
        tmp_path: Path, damage: str) -> None:
    run = _run(tmp_path / "run")
    tag = run / "checkpoints" / "global_step6"
    victim = {"tag deleted": tag, "shard deleted": tag / ckpt.optim_states_name(0),
              "shard cut": tag / ckpt.optim_states_name(0), "index cut": tag / INDEX,
              "model states deleted": tag / ckpt.MODEL_STATES}[damage]
    if damage == "tag deleted":
        import shutil
        shutil.rmtree(victim)
    elif damage.endswith("cut"):
        victim.write_bytes(victim.read_bytes()[:200])
    else:
        victim.unlink()
    # global_step4 is damaged too: the offer skips it
    (run / "checkpoints" / "global_step4" / ckpt.MODEL_STATES).unlink()
    _refused(run, named=victim, offered="global_step2")
    before = (run / "metrics.jsonl").read_text()
    decision = _decide(run, resume_from="global_step2")
    assert decision.resume_step == 2 and "--resume-from" in decision.message
    assert (run / "checkpoints" / "latest").read_text() == "global_step2"
    assert (run / "metrics.jsonl").read_text() == before         # the ranks set the rows aside, not the parent
    _refused(run, named=run / "checkpoints" / "global_step4", offered="global_step2", resume_from="global_step4")
    _refused(run, named=run / "checkpoints" / "global_step9", offered="global_step2", resume_from="global_step9")


def test_an_unreadable_latest_or_tags_without_latest_are_refused_with_the_offer(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    latest = run / "checkpoints" / "latest"
    for content in (b"\xff\xfeg\x00l\x00o\x00", b"", b"global_step6\nglobal_step4"):
        latest.write_bytes(content)
        _refused(run, named=latest, offered="global_step6")
    latest.unlink()
    _refused(run, named=run, offered="global_step6")
    assert _decide(run, resume_from="global_step6").resume_step == 6


def test_no_whole_tag_left_offers_only_overwrite_and_overwrite_and_resume_from_contradict(tmp_path: Path) -> None:
    run = _run(tmp_path / "run", tags=(2,))
    (run / "checkpoints" / "global_step2" / ckpt.optim_states_name(0)).unlink()
    _refused(run, named=run / "checkpoints" / "global_step2", offered=None)
    with pytest.raises(UserError, match="--resume-from and --overwrite contradict"):
        _decide(run, resume_from="global_step2", overwrite=True)
    assert _decide(run, overwrite=True).resume_step is None


def test_rows_after_the_resumed_step_are_set_aside_once(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4, 3, 4, 5)]    # a restart redid 3 and 4, then died
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert drop_rows_after(metrics, 2) == 5
    assert read_metrics(metrics) == rows[:2]
    assert read_metrics(tmp_path / "metrics.dropped.jsonl") == rows[2:]
    assert drop_rows_after(metrics, 2) == 0                             # nothing left to move
    assert drop_rows_after(tmp_path / "none.jsonl", 0) == 0
    assert drop_rows_after(metrics, 0) == 2                             # an attempt that saved nothing
    assert metrics.read_text() == "" and len(read_metrics(tmp_path / "metrics.dropped.jsonl")) == 7


def test_another_ranks_failed_save_is_a_consequence_and_the_cause_is_the_line(tmp_path: Path) -> None:
    from shardwise.cli.rank_reports import CRASH, failure_lines, write_failure
    from shardwise.errors import CheckpointError

    for rank, error in ((0, ckpt.SaveFailedElsewhere("saving checkpoint 'global_step2' failed on another rank")),
                        (1, CheckpointError("no space left to save /x/zero_pp_rank_1: it needs about 8 bytes"))):
        try:
            raise error
        except CheckpointError as e:
            report = write_failure(tmp_path, rank=rank, attempt=0, error=e)
        assert (report.kind == CRASH) == (rank == 0)
    code, lines = failure_lines(read_reports(tmp_path), {}, tmp_path)
    assert code == 2 and lines == ["shardwise: error: no space left to save /x/zero_pp_rank_1: it needs about 8 bytes"]


def test_a_rank_offers_the_previous_tag_only_when_the_tag_is_damaged(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from shardwise.cli.resume import resume
    from shardwise.errors import CheckpointError

    run = _run(tmp_path / "run")
    checkpoints = run / "checkpoints"

    def refusing(line: str):
        def load_checkpoint(directory: str):
            raise CheckpointError(line)
        return SimpleNamespace(lr_scheduler=None, load_checkpoint=load_checkpoint)

    layout = "written without a layout index (by an earlier shardwise) at dp=2; it loads only at that layout"
    with pytest.raises(CheckpointError) as error:             # the tag is whole: the refusal as it is
        resume(refusing(layout), None, checkpoints)
    assert str(error.value) == layout
    shard = checkpoints / "global_step6" / ckpt.optim_states_name(0)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF                              # one flipped byte: same size, another CRC-32
    shard.write_bytes(bytes(data))
    assert tag_problem(shard.parent) is None and str(shard) in tag_problem(shard.parent, every_byte=True)
    with pytest.raises(CheckpointError) as error:
        resume(refusing(f"checkpoint file {shard} is corrupt"), None, checkpoints)
    assert str(error.value).endswith("--resume-from global_step4")
    missing = SimpleNamespace(lr_scheduler=None, load_checkpoint=lambda directory: (None, None))
    (checkpoints / "latest").write_text("global_step9")        # a tag that is not there: never a fresh start
    # offered: the newest tag whose every byte checks (global_step6 has the flipped byte)
    with pytest.raises(CheckpointError, match="global_step9 named by .* is missing.*--resume-from global_step4"):
        resume(missing, None, checkpoints)


def test_a_killed_ranks_peers_losing_their_connection_are_said_on_its_line(tmp_path: Path) -> None:
    import signal

    from shardwise.cli.rank_reports import ProcessExit, failure_lines, write_failure

    for rank, text in ((1, "[pair.cc:537] Read error [127.0.0.1]:9619: Connection reset by peer. GLHF"),
                       (2, "recvValue failed on SocketImpl: Failed to recv, got 0 bytes"),
                       (3, "CUDA error: an illegal memory access")):
        try:
            raise RuntimeError(text)
        except RuntimeError as e:
            write_failure(tmp_path, rank=rank, attempt=0, error=e)
    killed = {0: ProcessExit(exitcode=-signal.SIGKILL, pid=42)}
    code, lines = failure_lines(read_reports(tmp_path), killed, tmp_path)
    assert code == 1 and len(lines) == 2, lines
    assert lines[0] == (f"shardwise: rank 0 was killed by SIGKILL (pid 42); rank(s) 1, 2 then lost their "
                        f"connection to it (tracebacks in {tmp_path})")
    assert lines[1].startswith("shardwise: rank 3 failed: RuntimeError: CUDA error")    # not a consequence
    # without a killed rank a lost connection is a failure of its own
    code, lines = failure_lines(read_reports(tmp_path), {}, tmp_path)
    assert len(lines) == 3 and all(" failed: " in line for line in lines)


def test_a_hang_is_the_verdicts_one_line_not_the_agents_kill_of_the_stalled_rank(tmp_path: Path) -> None:
    import signal
    import time

    from shardwise.cli.rank_reports import ProcessExit, failure_lines, write_failure
    from shardwise.errors import CollectiveTimeout

    line = ('rank(s) 1 stalled: rank(s) 0 waited 6 s for them in all_reduce on "world:check" #2 (collective timeout '
            'at steps [0, 1] after 6 s (communication.timeout_minutes)); rank(s) 1 did not arrive (rank 1: step 0, '
            'outside any collective, last completed all_gather on "dp" #2)')
    for rank, error in ((0, CollectiveTimeout(line)), (2, RuntimeError("Connection reset by peer"))):
        try:
            raise error
        except RuntimeError as e:
            write_failure(tmp_path, rank=rank, attempt=0, error=e)
        time.sleep(0.01)
    # the agent saw rank 0 fail, then killed the stalled rank 1 (and rank 2 lost its connection to it)
    exits = {0: ProcessExit(1, 40), 1: ProcessExit(-signal.SIGKILL, 41), 2: ProcessExit(1, 42)}
    code, lines = failure_lines(read_reports(tmp_path), exits, tmp_path)
    assert code == 1 and lines == [f"shardwise: {line} (reports in {tmp_path})"], lines
    # a crash reported before the hang is its likely cause: said first
    try:
        raise RuntimeError("CUDA error: an illegal memory access")
    except RuntimeError as e:
        report = write_failure(tmp_path, rank=3, attempt=0, error=e)
    path = tmp_path / "rank3.attempt0.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "time": report.time - 60}))
    code, lines = failure_lines(read_reports(tmp_path), exits, tmp_path)
    assert len(lines) == 2 and lines[0].startswith("shardwise: rank 3 failed: RuntimeError: CUDA error"), lines
    assert lines[1] == f"shardwise: {line} (reports in {tmp_path})"
