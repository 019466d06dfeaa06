"""DeepSpeed's checkpoint format, the parts checked without processes: its ZeRO flat layouts (against the
offsets DeepSpeed itself records in `param_slice_mappings` and the sizes zero_to_fp32.py assumes), and the loss
scaler our files carry as DeepSpeed's own object (fp16 cannot run on DeepSpeed's CPU accelerator, so the
dynamic scaler is checked here, not by a resumed run)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardwise.checkpoint import deepspeed_layout as layout
from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint.deepspeed_write import _DeepSpeedLossScaler, _Reference, loss_scaler

SIZES = st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=12)


@given(SIZES, st.integers(min_value=1, max_value=8))
def test_zero12_runs_tile_every_partition_once(numels: list[int], dp: int) -> None:
    pads = [0] * len(numels)
    part = layout.zero12_partition_numel(numels, pads, dp)
    assert part * dp % (2 * dp) == 0 and part * dp >= sum(numels)        # aligned to 2 x dp, holds everything
    seen = [[False] * part for _ in range(dp)]
    for numel, runs in zip(numels, layout.zero12_runs(numels, pads, dp)):
        assert sum(r.hi - r.lo for r in runs) == numel and runs[0].lo == 0 and runs[-1].hi == numel
        for r in runs:
            for i in range(r.dst, r.dst + r.hi - r.lo):
                assert not seen[r.rank][i]
                seen[r.rank][i] = True
    assert sum(map(sum, seen)) == sum(numels)


@given(SIZES, st.integers(min_value=1, max_value=8))
def test_zero3_runs_are_zero_to_fp32s_pieces(numels: list[int], dp: int) -> None:
    """zero_to_fp32.py: each parameter cut into dp pieces of ceil(numel / dp), rank r's flat tensor the pieces
    one after another."""
    offset = 0
    for numel, runs in zip(numels, layout.zero3_runs(numels, dp)):
        piece = math.ceil(numel / dp)
        assert [(r.lo, r.hi, r.dst) for r in runs] == [(k * piece, min(numel, (k + 1) * piece), offset)
                                                       for k in range(dp) if k * piece < numel]
        offset += piece
    assert layout.zero3_flat_numel(numels, dp) == offset


def test_zero12_runs_match_deepspeeds_slice_mappings() -> None:
    """The tiny GPT's 37 parameters at dp 2, as DeepSpeed 0.19 recorded rank 1's fragments: the last
    parameter of rank 0 (blocks.0.mlp.fc_out.weight, 4096 elements) continues at rank 1's offset 0."""
    numels = [8192, 512] + [32, 32, 1024, 32, 1024, 32, 1024, 32, 1024, 32, 32, 32, 4096, 128, 4096, 32] * 2 + \
        [32, 32, 8192]
    runs = layout.zero12_runs(numels, [0] * len(numels), 2)
    assert layout.zero12_partition_numel(numels, [0] * len(numels), 2) == 21184
    fc_out = runs[16]
    assert [(r.rank, r.lo, r.hi, r.dst) for r in fc_out] == [(0, 0, 3904, 17280), (1, 3904, 4096, 0)]
    assert [(r.rank, r.dst) for r in runs[-1]] == [(1, 12992)]


def test_dynamic_loss_scaler_is_deepspeeds_object(tmp_path) -> None:
    deepspeed_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    ours = {"cur_scale": 1024.0, "cur_iter": 17, "last_overflow_iter": 9, "cur_hysteresis": 1}
    torch.save({"s": loss_scaler(ours, {"fp16": {"enabled": True, "loss_scale_window": 50, "hysteresis": 3,
                                                   "min_loss_scale": 2}})}, tmp_path / "f.pt")
    got = torch.load(tmp_path / "f.pt", weights_only=False)["s"]
    assert type(got) is deepspeed_scaler.DynamicLossScaler
    assert (got.cur_scale, got.cur_iter, got.last_overflow_iter, got.cur_hysteresis) == (1024.0, 17, 9, 1)
    assert (got.scale_window, got.min_scale, got.delayed_shift) == (50, 2.0, 3)
    static = loss_scaler({"cur_scale": 1.0}, {})
    torch.save(static, tmp_path / "g.pt")
    assert type(torch.load(tmp_path / "g.pt", weights_only=False)) is deepspeed_scaler.LossScaler


def test_a_class_of_a_module_not_installed_reads_as_a_record(tmp_path) -> None:
    """Where DeepSpeed is not installed, our reader still opens the file: the scaler becomes a plain record."""
    class Absent(_DeepSpeedLossScaler):
        def __reduce__(self):
            return _Reference("no_such_module_for_shardwise", "Scaler"), self.args, self.state

    torch.save({"s": Absent("Scaler", (2.0,), {"cur_iter": 3}), "x": torch.ones(2)}, tmp_path / "f.pt")
    got = ckpt.torch_load(tmp_path / "f.pt")
    assert (got["s"].cls, got["s"].args, got["s"].cur_iter) == ("no_such_module_for_shardwise.Scaler", (2.0,), 3)
    assert got["x"].sum() == 2
