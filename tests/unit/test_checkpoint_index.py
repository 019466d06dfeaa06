"""The pure parts of a checkpoint's index: fragment coverage, the same-layout test, merging the ranks'
contributions, and the stored form (version 1: plain dicts and tuples) read back, also when damaged."""

import dataclasses
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.index import (
    INDEX as INDEX_FILE,
    CheckpointIndex,
    Dims,
    Fragment,
    IndexEntry,
    TensorInfo,
    covered,
    read_index,
    same_layout,
)
from shardwise.errors import CheckpointError

# Two ZeRO ranks, one bucket [a (6 elements), b (4)] padded to 10, shards of 5: rank 0 holds a[0:5], rank 1
# a[5:6] and b[0:4].
SHARD0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
SHARD1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"
ENTRIES = (IndexEntry(SHARD0, "optimizer_state_dict", 0, 0, 5, {"lr": 0.1}),
           IndexEntry(SHARD1, "optimizer_state_dict", 0, 0, 5, {"lr": 0.1}))
TENSORS = {"a": TensorInfo((2, 3), None), "b": TensorInfo((4,), None)}
INDEX = CheckpointIndex(dims=Dims(dp=2, tp=1, pp=1), tensors=TENSORS, module={"a": {0: MODEL}, "b": {0: MODEL}},
                        entries=ENTRIES,
                        fragments={"a": (Fragment(0, 0, 5, 0, 0), Fragment(0, 5, 6, 1, 0)),
                                   "b": (Fragment(0, 0, 4, 1, 1),)})
# What rank 1 writes (and reads back at this layout): its own entry, numbered 0.
RANK1 = CheckpointIndex(dims=Dims(dp=2, tp=1, pp=1), tensors=TENSORS, module={}, entries=(ENTRIES[1],),
                        fragments={"a": (Fragment(0, 5, 6, 0, 0),), "b": (Fragment(0, 0, 4, 0, 1),)})

# The same index as the shardwise before the dataclasses stored it: version 1, plain dicts and tuples.
STORED_V1 = {"version": 1,
             "tensors": {"a": ((2, 3), None), "b": ((4,), None)},
             "module": {"a": {0: MODEL}, "b": {0: MODEL}},
             "entries": [(SHARD0, "optimizer_state_dict", 0, 0, 5, {"lr": 0.1}),
                         (SHARD1, "optimizer_state_dict", 0, 0, 5, {"lr": 0.1})],
             "fragments": {"a": [(0, 0, 5, 0, 0), (0, 5, 6, 1, 0)], "b": [(0, 0, 4, 1, 1)]},
             "dims": {"dp": 2, "tp": 1, "pp": 1}}


def test_covered_needs_every_element_of_the_slice():
    assert covered(INDEX.fragments["a"], 0, 6)
    assert not covered(INDEX.fragments["a"][:1], 0, 6)              # a[5] is missing
    assert not covered([Fragment(0, 1, 6, 0, 0)], 0, 6)              # a[0] is missing
    assert not covered(INDEX.fragments["a"], 1, 6)                  # no TP rank 1 here


def test_same_layout_compares_this_ranks_entries_and_fragments():
    moved_lr = dataclasses.replace(RANK1, entries=(dataclasses.replace(ENTRIES[1], options={"lr": 0.05}),))
    assert same_layout(INDEX, moved_lr)                               # the lr may have moved: not compared
    assert not same_layout(INDEX, dataclasses.replace(moved_lr, dims=Dims(dp=4, tp=1, pp=1)))
    moved = dataclasses.replace(moved_lr, fragments={"a": (Fragment(0, 5, 6, 0, 0),), "b": (Fragment(0, 0, 4, 0, 2),)})
    assert not same_layout(INDEX, moved)
    bigger = dataclasses.replace(moved_lr, entries=(dataclasses.replace(ENTRIES[1], numel=6, options={}),))
    assert not same_layout(INDEX, bigger)


def test_merged_numbers_the_entries_of_every_rank_in_order():
    rank0 = CheckpointIndex(dims=Dims(dp=2, tp=1, pp=1), tensors=TENSORS, module={"a": {0: MODEL}, "b": {0: MODEL}},
                            entries=(ENTRIES[0],), fragments={"a": (Fragment(0, 0, 5, 0, 0),)})
    assert CheckpointIndex.merged([rank0, RANK1]) == INDEX


def test_a_version_1_index_reads_back_and_is_written_the_same(tmp_path: Path):
    torch.save(STORED_V1, tmp_path / INDEX_FILE)
    index = read_index(tmp_path)
    assert index == INDEX
    assert index.to_dict() == STORED_V1
    torch.save(index.to_dict(), tmp_path / INDEX_FILE)          # what a save writes now loads with weights_only
    assert torch.load(tmp_path / INDEX_FILE, weights_only=True) == STORED_V1
    assert read_index(tmp_path / "elsewhere") is None             # a tag written before indexes existed


def _without(raw: dict, key: str) -> dict:
    return {k: v for k, v in raw.items() if k != key}


DAMAGED = {
    "not a dict": ([1, 2], "the index is [1, 2], not a dict"),
    "no fragments": (_without(STORED_V1, "fragments"), "the index has no 'fragments'"),
    "no tp in dims": ({**STORED_V1, "dims": {"dp": 2, "pp": 1}}, "'dims' has no 'tp'"),
    "dims of text": ({**STORED_V1, "dims": {"dp": "2", "tp": 1, "pp": 1}}, "'dims'['dp'] is '2', not an integer"),
    "shape of text": ({**STORED_V1, "tensors": {"a": ("2x3", None)}}, "'tensors'['a'] shape is '2x3', not a tuple"),
    "short entry": ({**STORED_V1, "entries": [STORED_V1["entries"][0][:5]]}, "'entries'[0] is"),
    "negative lo": ({**STORED_V1, "fragments": {"a": [(0, -1, 5, 0, 0)]}}, "'fragments'['a'][0] is -1"),
    "no such entry": ({**STORED_V1, "fragments": {"a": [(0, 0, 5, 2, 0)]}}, "names no TP rank, run or entry"),
    "past the entry": ({**STORED_V1, "fragments": {"a": [(0, 0, 5, 0, 1)]}}, "names no TP rank, run or entry"),
    "no such TP rank": ({**STORED_V1, "module": {"a": {1: MODEL}}}, "'module'['a'] names TP rank 1"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_index_is_one_line_naming_the_file(tmp_path: Path, damage: str):
    raw, reason = DAMAGED[damage]
    torch.save(raw, tmp_path / INDEX_FILE)
    with pytest.raises(CheckpointError) as error:
        read_index(tmp_path)
    line = str(error.value)
    assert "\n" not in line
    assert line.startswith(f"checkpoint file {tmp_path / INDEX_FILE} is a damaged index: ") and reason in line, line


def test_another_version_or_an_unreadable_file_is_one_line_naming_the_file(tmp_path: Path):
    torch.save({**STORED_V1, "version": 4}, tmp_path / INDEX_FILE)
    with pytest.raises(CheckpointError, match="has index version 4; this shardwise reads versions 1, 2, 3") as error:
        read_index(tmp_path)
    assert str(tmp_path / INDEX_FILE) in str(error.value) and "\n" not in str(error.value)
    (tmp_path / INDEX_FILE).write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="is truncated or corrupt") as error:
        read_index(tmp_path)
    assert str(tmp_path / INDEX_FILE) in str(error.value) and "\n" not in str(error.value)
