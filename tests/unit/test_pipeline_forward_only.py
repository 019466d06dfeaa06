"""Evaluation passes: forward-only schedules (golden, valid, safe under NCCL's rules) and `PipelineRuntime.evaluate`
on one process (P = 1, V = 2: the chunks hand activations to each other without communication)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.parallel.pipeline import (
    Action, Op, PipelineError, build_programs, build_schedule, check_programs, check_schedule, format_actions,
    forward_only, validate_schedule)
from shardwise.parallel.pipeline.runtime import PipelineRuntime
from shardwise.parallel.pipeline.stage import PipelineModel, split_model


def test_golden_forward_only_keeps_each_stage_training_forward_order() -> None:
    interleaved = forward_only(build_schedule("interleaved_1f1b", num_stages=2, num_microbatches=4, virtual_stages=2))
    assert [format_actions(s) for s in interleaved] == ["F0 F1 F0.1 F1.1 F2 F3 F2.1 F3.1"] * 2
    for kind in ("gpipe", "1f1b"):
        plain = forward_only(build_schedule(kind, num_stages=3, num_microbatches=4))
        assert [format_actions(s) for s in plain] == ["F0 F1 F2 F3"] * 3


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_forward_only_programs_run_under_nccl_rules(kind: str) -> None:
    for p in range(1, 5):
        for m in range(1, 7):
            for v in ((1, 2, 3) if kind == "interleaved_1f1b" else (1,)):
                schedule = forward_only(build_schedule(kind, num_stages=p, num_microbatches=m, virtual_stages=v))
                assert validate_schedule(schedule) == (p, m, v)
                assert all(a.op is Op.FORWARD for s in schedule for a in s)
                check_programs(schedule, build_programs(schedule))
                timeline = check_schedule(schedule)
                assert timeline.makespan > 0, f"{kind} P={p} M={m} V={v} did not finish"


def test_validate_schedule_forward_only_rules() -> None:
    with pytest.raises(PipelineError, match="missing F1"):
        validate_schedule([[Action(Op.FORWARD, 0), Action(Op.FORWARD, 2)]])
    # backwards on one stage make it a training schedule: the stage without them is incomplete
    with pytest.raises(PipelineError, match="missing B0"):
        validate_schedule([[Action(Op.FORWARD, 0), Action(Op.BACKWARD, 0)], [Action(Op.FORWARD, 0)]])


def _layer_model() -> PipelineModel:
    torch.manual_seed(3)
    layers = [nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Tanh()) for _ in range(4)]
    return PipelineModel(layers, nn.functional.mse_loss)


def test_evaluate_on_one_stage_with_two_chunks_equals_the_model() -> None:
    model = _layer_model()
    stage = split_model(model, num_stages=1, stage=0, virtual_stages=2)
    runtime = PipelineRuntime(stage, Comm(None, CommLedger(), name="pp"), schedule="interleaved_1f1b",
                              num_microbatches=2)
    g = torch.Generator().manual_seed(0)
    micro = [(torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)) for _ in range(3)]
    model.eval()
    with torch.no_grad():
        expected = [float(model(x, y)) for x, y in micro]
    losses = runtime.evaluate(micro, num_microbatches=3)   # M differs from training's 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-6, atol=0)
    assert all(p.grad is None for p in stage.parameters())
    with pytest.raises(PipelineError, match="needs 3 micro-batches"):
        runtime.evaluate(micro[:2], num_microbatches=3)
    with pytest.raises(PipelineError, match="num_microbatches = 0"):
        runtime.evaluate(micro, num_microbatches=0)
    # a training step still runs after evaluations (nothing left over from them)
    result = runtime.step(micro[:2])
    assert len(result.losses) == 2 and all(p.grad is not None for p in stage.parameters())
