"""Checkpoint files carry their size and CRC-32 in the tag's index: every file a loader reads is checked, and a
flipped byte, a cut file, a damaged index, an unreadable `latest` or a full disk is one line naming the file.
Single process: `files.write_tag` with a one-rank seal, as `save_load.save` calls it."""

from __future__ import annotations

import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint import index as checkpoint_index
from shardwise.checkpoint.index import INDEX, CheckpointIndex, Dims, TensorInfo, read_checksums, read_index, sealed
from shardwise.checkpoint.reshard import FileReader
from shardwise.errors import CheckpointError

MODEL = ckpt.model_states_name(0)
SHARD = ckpt.optim_states_name(0)
LAYOUT = CheckpointIndex(dims=Dims(dp=1, tp=1, pp=1), tensors={"w": TensorInfo((64, 64), None)},
                         module={"w": {0: MODEL}}, entries=(), fragments={})


def _save(root: Path, tag: str = "global_step1") -> Path:
    files = {MODEL: {"module": {"w": torch.randn(64, 64)}, "global_steps": 1},
             SHARD: {"optimizer_state_dict": {"exp_avg": torch.randn(4096)}}}
    ckpt.write_tag(root, tag, files, seal=lambda sums: {INDEX: sealed(LAYOUT, sums)})
    return root / tag


def _one_line(error: pytest.ExceptionInfo, file: Path) -> str:
    line = str(error.value)
    assert "\n" not in line and str(file) in line, line
    return line


def test_the_index_holds_every_files_size_and_crc_and_the_files_read_back(tmp_path: Path) -> None:
    tag = _save(tmp_path)
    sums = read_index(tag).checksums
    assert set(sums) == {MODEL, SHARD}
    for name, expected in sums.items():
        assert ckpt.file_sum(tag / name) == expected           # summed while written = summed from disk
    read = FileReader(tag)
    assert read(MODEL)["global_steps"] == 1 and read(SHARD)["optimizer_state_dict"]["exp_avg"].numel() == 4096


def test_a_file_the_second_pass_rewrites_is_summed_as_rewritten(tmp_path: Path) -> None:
    """A ZeRO save's second pass (`then`) rewrites the shard with DeepSpeed's partition beside ours: the index
    holds the sum of the file as it ends on disk, and the second pass runs before the index is written."""
    seen_in_staging: list[bool] = []

    def then(staging: Path) -> dict[str, object]:
        seen_in_staging.append((staging / INDEX).exists())
        shard = FileReader(staging, sums={})(SHARD)
        return {SHARD: {**shard, "optimizer_state_dict": {"partition": torch.arange(100.0)}}}

    files = {MODEL: {"module": {"w": torch.randn(64, 64)}, "global_steps": 1},
             SHARD: {"shardwise_optimizer_state_dict": {"exp_avg": torch.randn(4096)}}}
    ckpt.write_tag(tmp_path, "t", files, then=then, seal=lambda sums: {INDEX: sealed(LAYOUT, sums)})
    tag = tmp_path / "t"
    sums = read_index(tag).checksums
    assert seen_in_staging == [False]
    assert set(sums) == {MODEL, SHARD} and all(ckpt.file_sum(tag / n) == s for n, s in sums.items())
    assert torch.equal(FileReader(tag)(SHARD)["optimizer_state_dict"]["partition"], torch.arange(100.0))


@pytest.mark.parametrize("victim", [MODEL, SHARD])
@pytest.mark.parametrize("damage", ["flip 64 bytes", "truncate", "append"])
def test_a_damaged_file_is_one_line_naming_it_before_it_is_unpickled(tmp_path: Path, victim: str,
                                                                        damage: str) -> None:
    tag = _save(tmp_path)
    data = bytearray((tag / victim).read_bytes())
    if damage == "flip 64 bytes":            # in the tensor data, where torch's reader finds nothing wrong
        middle = len(data) // 2
        data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    elif damage == "truncate":
        data = data[: len(data) - 100]
    else:
        data += b"\0" * 10
    (tag / victim).write_bytes(bytes(data))
    # the loader's reader, and the readers `shardwise eval` / `export` consolidate through
    direct = ckpt.read_model_states if victim == MODEL else lambda t: ckpt.read_optim_states(t, 0)
    for read in (FileReader(tag), direct):
        with pytest.raises(CheckpointError) as error:
            read(tag) if read is direct else read(victim)
        line = _one_line(error, tag / victim)
        assert ("is corrupt: its CRC-32" if damage == "flip 64 bytes" else "is truncated or corrupt") in line


def test_a_changed_index_is_refused_and_an_older_index_loads_unverified_said_once(tmp_path: Path) -> None:
    tag = _save(tmp_path)
    raw = torch.load(tag / INDEX, weights_only=True)
    raw["tensors"]["w"] = ((64, 65), None)              # a value changed, its CRC not
    torch.save(raw, tag / INDEX)
    with pytest.raises(CheckpointError, match="its contents do not match their CRC-32") as error:
        read_index(tag)
    _one_line(error, tag / INDEX)

    old = _save(tmp_path, "old")
    torch.save(LAYOUT.to_dict(), old / INDEX)            # version 1: no checksums
    assert read_index(old) == LAYOUT
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert read_checksums(old) is None and read_checksums(old) is None
        assert FileReader(old)(MODEL)["global_steps"] == 1
    assert len(said) == 1 and "without checking their checksums" in str(said[0].message)


def test_an_unreadable_latest_is_one_line(tmp_path: Path) -> None:
    _save(tmp_path)
    for content in (b"\xff\xfe\x00g\x00l", b"", b"global_step1\nglobal_step2", b"../elsewhere"):
        (tmp_path / "latest").write_bytes(content)
        with pytest.raises(CheckpointError) as error:
            ckpt.resolve_tag(tmp_path, None)
        assert "latest" in _one_line(error, tmp_path / "latest")
    (tmp_path / "latest").write_bytes(b"global_step1\n")
    assert ckpt.resolve_tag(tmp_path, None) == tmp_path / "global_step1"


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 512 KiB tmpfs (root only; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_one_line_naming_the_file_and_the_bytes_and_publishes_nothing(small_disk: Path) -> None:
    _save(small_disk)                                      # ~ 40 KB: fits
    big = {MODEL: {"module": {"w": torch.zeros(256, 1024)}}}    # 1 MiB of float32
    with pytest.raises(CheckpointError) as error:
        ckpt.write_tag(small_disk, "global_step2", big, seal=lambda sums: {INDEX: sealed(LAYOUT, sums)})
    line = _one_line(error, small_disk / ".global_step2.staging" / MODEL)
    assert f"needs about {256 * 1024 * 4:,} bytes" in line and "free" in line
    assert (small_disk / "latest").read_text() == "global_step1"
    assert not (small_disk / "global_step2").exists()
    assert FileReader(small_disk / "global_step1")(MODEL)["global_steps"] == 1

