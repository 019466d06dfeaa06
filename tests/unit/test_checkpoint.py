import os

import pytest
import torch

from shardwise.checkpoint import files as ckpt


def test_write_and_resolve(tmp_path):
    ckpt.write_tag(tmp_path, "a", {ckpt.MODEL_STATES: {"x": 1}})
    ckpt.write_tag(tmp_path, "b", {ckpt.MODEL_STATES: {"x": 2}})
    assert (tmp_path / "latest").read_text() == "b"
    assert ckpt.read_model_states(ckpt.resolve_tag(tmp_path, None)) == {"x": 2}
    assert ckpt.read_model_states(ckpt.resolve_tag(tmp_path, "a")) == {"x": 1}
    with pytest.warns(ckpt.CheckpointWarning):
        assert ckpt.resolve_tag(tmp_path / "empty", None) is None


def test_save_latest_false_writes_the_tag_and_keeps_latest(tmp_path):
    ckpt.write_tag(tmp_path, "a", {ckpt.MODEL_STATES: {"x": 1}})
    ckpt.write_tag(tmp_path, "b", {ckpt.MODEL_STATES: {"x": 2}}, save_latest=False)
    assert (tmp_path / "latest").read_text() == "a"
    assert ckpt.read_model_states(ckpt.resolve_tag(tmp_path, "b")) == {"x": 2}
    ckpt.write_tag(tmp_path / "fresh", "c", {ckpt.MODEL_STATES: {"x": 3}}, save_latest=False)
    with pytest.warns(ckpt.CheckpointWarning):                     # no `latest` was ever written there
        assert ckpt.resolve_tag(tmp_path / "fresh", None) is None


def test_overwriting_a_tag_replaces_it(tmp_path):
    ckpt.write_tag(tmp_path, "a", {ckpt.MODEL_STATES: {"x": 1}})
    ckpt.write_tag(tmp_path, "a", {ckpt.MODEL_STATES: {"x": 3}})
    assert ckpt.read_model_states(tmp_path / "a") == {"x": 3}
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ckpt.write_tag(tmp_path, "good", {ckpt.MODEL_STATES: {"x": 1}})

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        ckpt.write_tag(tmp_path, "good", {ckpt.MODEL_STATES: {"x": 2}})
    with pytest.raises(OSError):
        ckpt.write_tag(tmp_path, "next", {ckpt.MODEL_STATES: {"x": 2}})
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "good"
    assert ckpt.read_model_states(tmp_path / "good") == {"x": 1}
    assert sorted(os.listdir(tmp_path)) == ["good", "latest"]


def test_missing_tag_warns_names_what_exists_and_loads_nothing(tmp_path):
    ckpt.write_tag(tmp_path, "a", {ckpt.MODEL_STATES: {}})
    with pytest.warns(ckpt.CheckpointWarning, match="no tag 'zzz' .*tags present: \\['a'\\]"):
        assert ckpt.resolve_tag(tmp_path, "zzz") is None
    with pytest.warns(ckpt.CheckpointWarning, match="unable to find latest file"):
        assert ckpt.resolve_tag(tmp_path / "nowhere", None) is None
    (tmp_path / "b").mkdir()                       # a tag directory without its model states is damaged
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.resolve_tag(tmp_path, "b")
    with pytest.raises(ckpt.CheckpointError, match="tag"):
        ckpt.write_tag(tmp_path, "../x", {})


def test_next_save_removes_stale_staging_of_any_tag_only_ours(tmp_path):
    killed = tmp_path / ".global_step7.staging"          # what a save killed mid-write leaves
    killed.mkdir(parents=True)
    (killed / "mp_rank_00_model_states.pt").write_bytes(b"half")
    (killed / "zero_pp_rank_1_mp_rank_00_optim_states.pt.tmp-x1").write_bytes(b"")
    foreign = tmp_path / ".notes.staging"                 # someone else's: not only our files
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep me")
    ckpt.write_tag(tmp_path, "a", {ckpt.MODEL_STATES: {"x": 1}})
    assert not killed.exists()
    assert (foreign / "todo.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == [".notes.staging", "a", "latest"]


def test_a_failed_save_leaves_other_staging_alone(tmp_path):
    """Stale folders are removed only once every rank wrote its files (here: the one rank failed)."""
    killed = tmp_path / ".old.staging"
    killed.mkdir(parents=True)
    with pytest.raises(ckpt.CheckpointError):
        ckpt.write_tag(tmp_path, "b", {ckpt.MODEL_STATES: {"x": 1}}, any_failed=lambda failed: True)
    assert killed.exists()
