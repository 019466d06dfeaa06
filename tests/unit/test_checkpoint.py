import os

import pytest
import torch

from shardwise import checkpoint as ckpt


def test_write_and_resolve(tmp_path):
    ckpt.write_tag(tmp_path, "a", {ckpt.MODEL_STATES: {"x": 1}})
    ckpt.write_tag(tmp_path, "b", {ckpt.MODEL_STATES: {"x": 2}})
    assert (tmp_path / "latest").read_text() == "b"
    assert ckpt.read_model_states(ckpt.resolve_tag(tmp_path, None)) == {"x": 2}
    assert ckpt.read_model_states(ckpt.resolve_tag(tmp_path, "a")) == {"x": 1}
    assert ckpt.resolve_tag(tmp_path / "empty", None) is None


def test_save_latest_false_writes_the_tag_and_keeps_latest(tmp_path):
    ckpt.write_tag(tmp_path, "a", {ckpt.MODEL_STATES: {"x": 1}})
    ckpt.write_tag(tmp_path, "b", {ckpt.MODEL_STATES: {"x": 2}}, save_latest=False)
    assert (tmp_path / "latest").read_text() == "a"
    assert ckpt.read_model_states(ckpt.resolve_tag(tmp_path, "b")) == {"x": 2}
    ckpt.write_tag(tmp_path / "fresh", "c", {ckpt.MODEL_STATES: {"x": 3}}, save_latest=False)
    assert ckpt.resolve_tag(tmp_path / "fresh", None) is None      # no `latest` was ever written there


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


def test_missing_tag_names_what_exists(tmp_path):
    ckpt.write_tag(tmp_path, "a", {ckpt.MODEL_STATES: {}})
    with pytest.raises(ckpt.CheckpointError, match="tags present: \\['a'\\]"):
        ckpt.resolve_tag(tmp_path, "zzz")
    with pytest.raises(ckpt.CheckpointError, match="tag"):
        ckpt.write_tag(tmp_path, "../x", {})
