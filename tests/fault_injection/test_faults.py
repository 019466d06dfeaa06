"""Fault injection: every fault a long run can meet is survived (the run continues with nothing lost) or refused
in one line naming what is wrong; never a silent restart, never a silent load of damaged data.

Two groups, each sharing its processes:
- damaged checkpoints (`DAMAGE`), in one 2-rank launch at ZeRO-1 (so every rank has an optimizer shard): each
  fault is applied to a copy of one good tag, then both ranks load it through `engine.load_checkpoint`, at ZeRO-1
  and, for a damaged fragment (`RESHARD_DAMAGE`), at ZeRO-0, where the ranks read the shards piece by piece;
- `shardwise train` as a user runs it, on the tiny preset with 2 ranks: a rank killed (restarted, resumed, its
  dead attempt's metrics rows set aside), a flipped optimizer shard (refused, the previous complete tag offered,
  resumed from it with `--resume-from`), a deleted tag, an unreadable `latest`, rank 0 (the store's host) killed,
  an extra collective on one rank (one DesyncError line, the last complete tag kept), then in the same run a
  rank that stalls (one line naming it, first), a full disk during a save.

Each test prints its table (`pytest -s`): fault, what happened, verdict."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint.index import INDEX, read_index
from shardwise.cli.resume import tag_problem
from shardwise.telemetry import read_metrics
from shardwise.testing import micro_steps, run_distributed, tiny_gpt, token_batches

SEQ, BATCH = 16, 4
GOOD = "good"
SHARD1 = ckpt.optim_states_name(1)


def _flip(file: Path, count: int = 64) -> None:
    """Invert `count` bytes in the middle of the file (inside the tensor data: torch's reader sees nothing)."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


# fault -> (what it does to ROOT (holding a copy of the good tag and `latest`), the path a refusal must name;
# None: the fault is survived, the tag loads as saved)
DAMAGE: dict[str, tuple[Callable[[Path], None], Callable[[Path], Path] | None]] = {
    "corrupt optimizer shard (64 bytes)": (lambda r: _flip(r / GOOD / SHARD1), lambda r: r / GOOD / SHARD1),
    "corrupt model states (64 bytes)": (lambda r: _flip(r / GOOD / ckpt.MODEL_STATES),
                                        lambda r: r / GOOD / ckpt.MODEL_STATES),
    "corrupt index (64 bytes)": (lambda r: _flip(r / GOOD / INDEX), lambda r: r / GOOD / INDEX),
    "truncate optimizer shard": (lambda r: _truncate(r / GOOD / SHARD1), lambda r: r / GOOD / SHARD1),
    "truncate index": (lambda r: _truncate(r / GOOD / INDEX), lambda r: r / GOOD / INDEX),
    "delete optimizer shard": (lambda r: (r / GOOD / SHARD1).unlink(), lambda r: r / GOOD / SHARD1),
    "delete model states": (lambda r: (r / GOOD / ckpt.MODEL_STATES).unlink(), lambda r: r / GOOD),
    "delete tag": (lambda r: shutil.rmtree(r / GOOD), lambda r: r),        # "no tag 'good' in ROOT"
    "non-UTF-8 latest": (lambda r: (r / "latest").write_bytes(b"\xff\xfe\x00\x01"), lambda r: r / "latest"),
    "delete index (loads unverified, said once)": (lambda r: (r / GOOD / INDEX).unlink(), None),
}


def _flip_fragment(root: Path) -> None:
    """Invert 64 bytes inside the Adam state of one fragment of rank 1's optimizer shard (what a rank loading at
    another layout reads through the memory map, without reading the whole file)."""
    index = read_index(root / GOOD)
    name, j, f = next((n, j, f) for n, frags in sorted(index.fragments.items()) for j, f in enumerate(frags)
                      if index.entries[f.entry].file == SHARD1 and f.hi - f.lo >= 64)
    entry = index.entries[f.entry]
    state = ckpt.torch_load(root / GOOD / SHARD1)[entry.key]["optimizer"]["state"][entry.optimizer_index]
    piece = state["exp_avg_sq"][f.dst:f.dst + f.hi - f.lo].contiguous()
    data = bytearray((root / GOOD / SHARD1).read_bytes())
    at = data.find(piece.view(torch.uint8).numpy().tobytes()) + piece.numel() * piece.element_size() // 2 - 32
    data[at:at + 64] = bytes(b ^ 0xFF for b in data[at:at + 64])
    (root / GOOD / SHARD1).write_bytes(bytes(data))


# fault -> (damage, path named), as DAMAGE, loaded at ZeRO-0 (another layout: read piece by piece through the index)
RESHARD_DAMAGE: dict[str, tuple[Callable[[Path], None], Callable[[Path], Path]]] = {
    "corrupt a fragment (64 bytes), loaded at ZeRO-0": (_flip_fragment, lambda r: r / GOOD / SHARD1),
}


def _engine(stage: int = 1):
    import shardwise
    config = {"train_batch_size": BATCH, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    net = tiny_gpt(seq_len=SEQ, seed=5)
    engine, *_ = shardwise.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine


def _step(engine, seed: int) -> None:
    rows = token_batches(1, BATCH, SEQ + 1, seed=seed)
    for batch in micro_steps(rows, dp_size=engine.dp_size, dp_rank=engine.dp_rank, grad_accum=1):
        engine.train_batch(iter(batch))


def _weights(engine) -> list[torch.Tensor]:
    """The module's parameters and what the optimizer steps (at ZeRO-3 the parameters are placeholders between
    uses: the stepped shards hold the values)."""
    stepped = [p for group in engine.optimizer.param_groups for p in group["params"]]
    return [p.detach().clone() for p in [*engine.module.parameters(), *stepped]]


def _load_damaged(root: str) -> dict:
    """On each rank: save one good tag, then for every fault load a damaged copy; what happened to the weights."""
    import warnings

    import torch.distributed as dist

    engine = _engine()
    _step(engine, 0)
    good_dir = Path(root, "saved")
    engine.save_checkpoint(str(good_dir), tag=GOOD)
    saved = _weights(engine)
    _step(engine, 1)                            # the weights now differ from the tag's
    moved = _weights(engine)
    out: dict = {}
    for name, (damage, _) in [*DAMAGE.items(), *RESHARD_DAMAGE.items()]:
        where = Path(root, name.split(" (")[0].replace(" ", "-"))
        if dist.get_rank() == 0:
            shutil.copytree(good_dir, where)
            damage(where)
        dist.barrier()
        if name in RESHARD_DAMAGE and engine.zero_optimization_stage() != 0:
            engine.close()                  # the rest of the faults at ZeRO-0: another engine, its own weights
            engine = _engine(0)
            moved = _weights(engine)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                path, _ = engine.load_checkpoint(str(where))
                outcome = ("loaded", str(path))
            except Exception as e:  # noqa: BLE001 - the outcome under test
                outcome = ("refused", f"{type(e).__name__}: {e}")
        now = _weights(engine)
        same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))      # noqa: E731
        out[name] = {"outcome": outcome, "warnings": [str(w.message) for w in said],
                     "unchanged": same(now, moved), "as_saved": same(now, saved)}
        if outcome[0] == "loaded":              # back to the moved weights for the next fault
            for p, w in zip([*engine.module.parameters(), *(p for g in engine.optimizer.param_groups
                                                              for p in g["params"])], moved):
                p.data.copy_(w)
    engine.close()
    return out


def _table(title: str, rows: list[tuple[str, str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"\n{title}")
    for fault, what, verdict in rows:
        print(f"  {fault:<{width}}  {verdict:<10}  {what[:160]}")
    count = {v: sum(r[2].startswith(v) for r in rows) for v in ("survived", "refused", "reported", "skipped")}
    print(f"  {len(rows)} faults injected: {count['survived']} survived, {count['refused']} refused in one line, "
          f"{count['reported']} crashes reported naming the rank (no run survives them without --max-restarts), "
          f"{count['skipped']} not run here")


def test_damaged_checkpoints_are_refused_in_one_line_naming_the_file_or_load_as_saved(tmp_path: Path) -> None:
    results = run_distributed(_load_damaged, 2, args=(str(tmp_path),), timeout=300)
    rows = []
    for name, (_, named) in [*DAMAGE.items(), *RESHARD_DAMAGE.items()]:
        where = tmp_path / name.split(" (")[0].replace(" ", "-")
        per_rank = [r[name] for r in results]
        kind, text = per_rank[0]["outcome"]
        if named is None:
            # survived: the same data loaded on every rank, and one warning said it was not verified
            assert all(r["outcome"][0] == "loaded" and r["as_saved"] for r in per_rank), (name, per_rank)
            assert all(len(r["warnings"]) == 1 and "without checking" in r["warnings"][0] for r in per_rank)
            rows.append((name, per_rank[0]["warnings"][0], "survived"))
            continue
        lines = {r["outcome"][1] for r in per_rank}
        if kind == "loaded":        # the API's documented answer for no tag: (None, None) and one warning
            assert all(r["outcome"] == ("loaded", "None") and r["unchanged"] for r in per_rank), (name, per_rank)
            assert all(len(r["warnings"]) == 1 and str(named(where)) in r["warnings"][0] for r in per_rank)
            rows.append((name, per_rank[0]["warnings"][0], "refused"))
            continue
        assert len(lines) == 1, f"{name}: the ranks disagree: {lines}"
        line = lines.pop()
        assert "\n" not in line and str(named(where)) in line and line.startswith("CheckpointError"), (name, line)
        assert name not in RESHARD_DAMAGE or "is corrupt: fragment " in line, line
        assert all(r["unchanged"] for r in per_rank), f"{name}: weights changed before the refusal"
        rows.append((name, line, "refused"))
    _table("damaged checkpoints (engine.load_checkpoint, 2 ranks, ZeRO-1 and 0):", rows)


# -- shardwise train ------------------------------------------------------------------------------------------------
TRAIN = [sys.executable, "-m", "shardwise.cli.main", "train"]
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 1},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _corpus(path: Path) -> Path:
    path.write_text((Path(json.__file__).read_text() * 40)[:60_000])
    return path


def _train(args: list[str], timeout: float = 240, **env: str) -> tuple[int, str, str]:
    proc = subprocess.run(TRAIN + args, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def _steps(metrics: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics(metrics)]


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 384 KiB tmpfs: room for a run's small files, not for a checkpoint of the tiny preset; None where it
    cannot be mounted (root only)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=384k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        yield None
        return
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def stall_rank_after_step(*, rank: int, step: int) -> dict[str, str]:
    """The environment in which global rank `rank` stops answering once step `step` is done (sitecustomize)."""
    from fault_injection.sitecustomize import STALL_ENV

    here = str(Path(__file__).parent)
    path = [here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(path), STALL_ENV: f"{rank}:{step}"}


def extra_collective_in_step(*, rank: int, step: int) -> dict[str, str]:
    """The environment in which global rank `rank` runs one extra all-reduce, recorded by its ledger, in step `step`
    (sitecustomize)."""
    from fault_injection.sitecustomize import EXTRA_COLLECTIVE_ENV

    here = str(Path(__file__).parent)
    path = [here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(path), EXTRA_COLLECTIVE_ENV: f"{rank}:{step}:ledger"}


# Nine launches of `shardwise train` in one test (4-5 minutes on 2 loaded cores): past the default per-test limit.
@pytest.mark.timeout(600)
def test_train_survives_or_refuses_in_one_line_with_nothing_lost(tmp_path: Path, kill_rank_after_step,
                                                                   small_disk: Path | None) -> None:
    corpus = _corpus(tmp_path / "corpus.txt")
    config = tmp_path / "zero1.json"
    config.write_text(json.dumps(CONFIG))
    out = tmp_path / "run"
    common = [str(config), "--nproc", "2", "--model", "tiny", "--data", str(corpus), "--seq-len", "32",
              "--peak-tflops", "0.1", "--save-every", "2", "--out", str(out)]
    metrics, checkpoints = out / "metrics.jsonl", out / "checkpoints"
    rows: list[tuple[str, str, str]] = []

    # kill -9 of rank 1 after step 3: the restarted ranks resume from step 2; the dead attempt's row of step 3
    # is set aside, so every step appears once.
    code, stdout, stderr = _train(common + ["--steps", "4", "--max-restarts", "1"],
                                  **kill_rank_after_step(rank=1, step=3))
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    assert _steps(metrics) == [1, 2, 3, 4]
    assert _steps(out / "metrics.dropped.jsonl") == [3]
    rows.append(("kill -9 of rank 1 after step 3", "restarted, resumed at step 2, step 3's dead row set aside",
                 "survived"))

    # 64 bytes flipped in rank 1's optimizer shard of the newest tag: refused before training, naming the file
    # and offering the previous complete tag; then resumed from it with --resume-from.
    shard = checkpoints / "global_step4" / SHARD1
    _flip(shard)
    code, stdout, stderr = _train(common + ["--steps", "6"])
    line = _one_line(stderr)
    assert code == 2 and str(shard) in line and "--resume-from global_step2" in line, line
    assert _steps(metrics) == [1, 2, 3, 4]                          # nothing trained, nothing written
    rows.append(("64 bytes flipped in an optimizer shard", line, "refused"))
    code, stdout, stderr = _train(common + ["--steps", "6", "--resume-from", "global_step2"])
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    assert _steps(metrics) == [1, 2, 3, 4, 5, 6]
    assert _steps(out / "metrics.dropped.jsonl") == [3, 3, 4]
    assert (checkpoints / "latest").read_text() == "global_step6"
    assert read_index(shard.parent).checksums[SHARD1] == ckpt.file_sum(shard)     # rewritten by the resumed run
    rows.append(("--resume-from the previous tag", "resumed at step 2; steps 3-6 once each", "survived"))

    # The tag `latest` names deleted: refused by the parent in one line, the previous complete tag offered.
    shutil.rmtree(checkpoints / "global_step6")
    code, stdout, stderr = _train(common + ["--steps", "8"])
    line = _one_line(stderr)
    assert code == 2 and str(checkpoints / "global_step6") in line and "--resume-from global_step4" in line, line
    rows.append(("the tag latest names deleted", line, "refused"))

    (checkpoints / "latest").write_bytes(b"\xff\xfe\x00g\x00")
    code, stdout, stderr = _train(common + ["--steps", "8"])
    line = _one_line(stderr)
    assert code == 2 and str(checkpoints / "latest") in line, line
    rows.append(("non-UTF-8 latest", line, "refused"))
    assert _steps(metrics) == [1, 2, 3, 4, 5, 6]

    # kill -9 of rank 0, which hosts the rendezvous store: one line (rank 1's lost connection said on it; a
    # second line only if the launcher ended rank 1 before it reported), no C++ store traces.
    code, stdout, stderr = _train(common[:-1] + [str(tmp_path / "lost0"), "--steps", "3"],
                                  **kill_rank_after_step(rank=0, step=1))
    lines = stderr.strip().splitlines()
    assert code == 1 and 1 <= len(lines) <= 2 and "frame #" not in stderr and "Traceback" not in stderr, stderr
    assert lines[0].startswith("shardwise: rank 0 was killed by SIGKILL"), stderr
    assert len(lines) == 2 or "rank(s) 1 then lost their connection to it" in lines[0], stderr
    rows.append(("kill -9 of rank 0 (the store's host)", " / ".join(lines),
                 "reported" if len(lines) == 1 else "reported in 2 lines"))

    # Rank 1 runs one extra collective in step 3 (a strategy's stray all-reduce): it waits in it while rank 0 waits
    # in its gradient reduce-scatter (they cannot pair: no size check fires); after --timeout one DesyncError line
    # naming the ranks and what each ran, exit 2. Nothing lost: `latest` names the complete step-2 tag, the metrics
    # hold steps 1-2.
    drift = tmp_path / "drift"
    code, stdout, stderr = _train(common[:-1] + [str(drift), "--steps", "4", "--timeout", "0.1"],
                                  **extra_collective_in_step(rank=1, step=3))
    line = _one_line(stderr)
    assert code == 2 and line.startswith("shardwise: error: desync at step 2: operation "), line
    assert "rank(s) 1 ran all_reduce float32[3]" in line and "rank(s) 0 ran " in line, line
    assert (drift / "checkpoints" / "latest").read_text() == "global_step2"
    assert tag_problem(drift / "checkpoints" / "global_step2", every_byte=True) is None
    assert _steps(drift / "metrics.jsonl") == [1, 2]
    rows.append(("an extra collective on rank 1 in step 3", line, "refused"))

    # The same run resumed, and rank 1 stops answering after step 3 (a frozen node): after --timeout one line,
    # first, naming the stalled rank, the collective the others waited in for it and how long; not the agent's
    # kill of the stalled rank, not each rank's report. The resume continued the drifted run at step 2.
    code, stdout, stderr = _train(common[:-1] + [str(drift), "--steps", "4", "--timeout", "0.1"],
                                  **stall_rank_after_step(rank=1, step=3))
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr and "frame #" not in stderr, stderr
    assert lines[0].startswith("shardwise: rank(s) 1 stalled: rank(s) 0 waited "), stderr
    assert "s for them in all_reduce on " in lines[0] and "rank(s) 1 did not arrive (rank 1: " in lines[0]
    assert _steps(drift / "metrics.jsonl") == [1, 2, 3]
    assert (drift / "checkpoints" / "latest").read_text() == "global_step2"
    rows.append(("rank 1 stalls after step 3 (--timeout 0.1)", lines[0], "reported"))

    # A full disk during the first save: one line naming the file and the bytes, exit 2, nothing published.
    if small_disk is None:
        rows.append(("disk full during a save", "not run: mounting a small tmpfs needs root", "skipped"))
        _table("shardwise train (tiny, 2 ranks):", rows)
        return
    disk_out = small_disk / "run"
    code, stdout, stderr = _train(common[:-1] + [str(disk_out), "--steps", "2"])
    line = _one_line(stderr)
    assert code == 2 and "no space left to save " + str(disk_out / "checkpoints") in line, line
    assert "bytes" in line and not (disk_out / "checkpoints" / "latest").exists()
    rows.append(("disk full during a save", line, "refused"))
    _table("shardwise train (tiny, 2 ranks):", rows)
