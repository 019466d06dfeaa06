"""A checkpoint's index holds a CRC-32 per piece a loader reads through the memory map (version 3): per fragment
and saved tensor, per module tensor, and per file one over its pickle and its tensors outside the index. A load
at another layout checks exactly the pieces it reads (not whole files), and a damaged piece is one line naming
the file and the piece, before anything changes. At the writer's layout the files are read, and checked, whole.

In-process world of one: ZeRO-1 writes an optimizer shard; ZeRO-0 reads it back through the index (resharding)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint import reshard
from shardwise.checkpoint.index import INDEX, read_index, sealed
from shardwise.errors import CheckpointError
from shardwise.testing import micro_steps, tiny_gpt, token_batches

# initialize() here makes a world of one in this process: torn down after this file (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_world_left_behind")

SHARD = ckpt.optim_states_name(0)


def _engine(stage: int):
    net = tiny_gpt(n_layer=1, seq_len=16, seed=5)
    config = {"train_batch_size": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = shardwise.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine


MARKER = torch.arange(100, dtype=torch.int64) + 123_456_789       # a client-state tensor no index maps


def _saved(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    engine = _engine(1)
    for batch in micro_steps(token_batches(1, 2, 17, seed=0), dp_size=1, dp_rank=0, grad_accum=1):
        engine.train_batch(iter(batch))
    engine.save_checkpoint(str(root), tag="t", client_state={"marker": MARKER})
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return root / "t", weights


def _readers(monkeypatch: pytest.MonkeyPatch) -> list[reshard.FileReader]:
    """Every FileReader made from now on (the loader's own are not returned to the caller)."""
    made: list[reshard.FileReader] = []
    init = reshard.FileReader.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(reshard.FileReader, "__init__", recorded)
    return made


def _flip_inside(file: Path, tensor: torch.Tensor) -> None:
    """Invert 8 bytes in the middle of `tensor`'s bytes as `file` holds them."""
    data = bytearray(file.read_bytes())
    at = data.find(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    assert at >= 0
    at += tensor.numel() * tensor.element_size() // 2
    data[at:at + 8] = bytes(b ^ 0xFF for b in data[at:at + 8])
    file.write_bytes(bytes(data))


def test_every_piece_has_its_sum_and_a_resharding_load_checks_only_what_it_reads(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    tag, weights = _saved(tmp_path)
    index = read_index(tag)
    assert index.pieces is not None and set(index.pieces.rest) == set(index.checksums)
    for name, frags in index.fragments.items():
        sums = index.pieces.fragments[name]
        assert len(sums) == len(frags) and all(set(s) == {"value", "exp_avg", "exp_avg_sq"} for s in sums), name
    assert {n: set(r) for n, r in index.pieces.module.items()} == {n: set(r) for n, r in index.module.items()}
    made = _readers(monkeypatch)
    engine = _engine(0)                         # stage 0 reads the ZeRO-1 shard through the index
    engine.load_checkpoint(str(tmp_path), tag="t")
    assert all(torch.equal(v, weights[k]) for k, v in engine.module.state_dict().items())
    (mapped,) = [r for r in made if r.mmap]
    assert not [r for r in made if not r.mmap]              # no file read whole
    whole = sum(s.size for n, s in index.checksums.items() if n in mapped._open)
    # what it checked: its fragments' bytes (value and two Adam states) and module tensors, plus each file's
    # rest; not DeepSpeed's copy of the shard, which is most of the shard file
    pieces = sum(4 * (f.hi - f.lo) * 3 for frags in index.fragments.values() for f in frags) + \
        sum(t.numel() * t.element_size() for t in weights.values())
    assert pieces <= mapped.bytes_checked < pieces + 64 * 1024 < whole, (mapped.bytes_checked, pieces, whole)
    engine.close()


def test_a_damaged_fragment_is_one_line_naming_the_file_and_the_fragment_before_any_change(tmp_path: Path) -> None:
    tag, _ = _saved(tmp_path)
    index = read_index(tag)
    name, frags = next(iter(index.fragments.items()))
    entry = index.entries[frags[0].entry]
    saved = ckpt.torch_load(tag / SHARD)[entry.key]["optimizer"]["state"][entry.optimizer_index]["exp_avg_sq"]
    _flip_inside(tag / SHARD, saved[frags[0].dst:frags[0].dst + frags[0].hi - frags[0].lo])
    engine = _engine(0)
    before = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(CheckpointError) as error:
        engine.load_checkpoint(str(tmp_path), tag="t")
    line = str(error.value)
    assert "\n" not in line and line.startswith(f"checkpoint file {tag / SHARD} is corrupt: fragment 0 of "
                                                f"{name!r} (exp_avg_sq: elements [{frags[0].lo}, "), line
    assert all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())
    engine.close()
    # at the writer's layout the file is read whole, and its CRC-32 says so
    engine = _engine(1)
    with pytest.raises(CheckpointError, match=f"checkpoint file {tag / SHARD} is corrupt: its CRC-32 is"):
        engine.load_checkpoint(str(tmp_path), tag="t")
    engine.close()


def test_a_damaged_module_tensor_or_pickle_is_one_line_naming_the_file(tmp_path: Path) -> None:
    tag, weights = _saved(tmp_path)
    model = tag / ckpt.MODEL_STATES
    good = model.read_bytes()
    name = "transformer.ln_f.weight" if "transformer.ln_f.weight" in weights else sorted(weights)[-1]
    _flip_inside(model, weights[name])
    with pytest.raises(CheckpointError) as error:
        _engine(0).load_checkpoint(str(tmp_path), tag="t")
    assert str(error.value).startswith(f"checkpoint file {model} is corrupt: module tensor {name!r}"), error.value
    # a Python value in the pickle changed, which unpickles without complaint (the config's optimizer type): the
    # zip record's own CRC-32 (checked by the zip reader that reads the pickle to sum it) or the rest sum says so
    assert good.count(b"AdamW") >= 1
    model.write_bytes(good.replace(b"AdamW", b"AdamV", 1))
    with pytest.raises(CheckpointError) as error:
        _engine(0).load_checkpoint(str(tmp_path), tag="t")
    line = str(error.value)
    assert "\n" not in line and line.startswith(f"checkpoint file {model} is "), line
    assert "Bad CRC-32 for file 'archive/data.pkl'" in line or "its pickle and the tensors outside" in line, line
    # a tensor outside the index (the client state's), which torch's reader takes as it is: the rest sum differs
    model.write_bytes(good)
    _flip_inside(model, MARKER)
    with pytest.raises(CheckpointError) as error:
        _engine(0).load_checkpoint(str(tmp_path), tag="t")
    assert str(error.value).startswith(f"checkpoint file {model} is corrupt: its pickle and the tensors outside "
                                       f"its index have CRC-32 "), error.value


def test_a_version_2_index_checks_whole_files_as_before(tmp_path: Path, monkeypatch) -> None:
    tag, weights = _saved(tmp_path)
    index = read_index(tag)
    torch.save(sealed(index, index.checksums), tag / INDEX)         # no piece sums: version 2
    assert read_index(tag).pieces is None
    made = _readers(monkeypatch)
    engine = _engine(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # checked, so nothing is said
        engine.load_checkpoint(str(tmp_path), tag="t")
    assert all(torch.equal(v, weights[k]) for k, v in engine.module.state_dict().items())
    (mapped,) = [r for r in made if r.mmap]
    assert mapped.bytes_checked == sum(s.size for n, s in index.checksums.items() if n in mapped._open)
    engine.close()


def test_a_rank_that_cannot_sum_its_pieces_still_seals_and_its_files_are_checked_whole(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """Summing is inside the seal, which is collective: a rank whose summing fails (its write failed, say) must
    still reach the gather; its files then carry no piece sums, and a loader checks them whole."""
    def failing(*args, **kwargs):
        raise OSError("a staged file went missing")

    monkeypatch.setattr(reshard, "piece_sums", failing)
    tag, weights = _saved(tmp_path)
    index = read_index(tag)
    # (one rank here: no piece sums at all, so the index is of version 2)
    assert index.pieces is None and set(index.checksums) == {ckpt.MODEL_STATES, SHARD}
    monkeypatch.undo()
    made = _readers(monkeypatch)
    engine = _engine(0)
    engine.load_checkpoint(str(tmp_path), tag="t")
    assert all(torch.equal(v, weights[k]) for k, v in engine.module.state_dict().items())
    (mapped,) = [r for r in made if r.mmap]
    assert mapped.bytes_checked == sum(s.size for n, s in index.checksums.items() if n in mapped._open)
    engine.close()
