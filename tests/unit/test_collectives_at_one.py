"""The test switch SHARDWISE_COLLECTIVES_AT_WORLD_1: a world of one runs its collectives through the backend (what
lets one GPU exercise NCCL's kernels). Checked on gloo: the collectives happen (the ledger records them), and
the training is bitwise the run without them (a sum over one rank is the identity)."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm.collectives import COLLECTIVES_AT_ONE_ENV
from shardwise.testing import lm_pair, tiny_gpt, token_batches

STAGES = (0, 2, 3)


def _train(stage: int) -> tuple[list[float], dict[str, torch.Tensor], set[tuple[str, str]]]:
    import shardwise
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    engine, *_ = shardwise.initialize(model=tiny_gpt(n_layer=1), config=config)
    batches = iter([lm_pair(b) for b in token_batches(4, 2, 17, seed=5)])
    losses = [float(engine.train_batch(batches)) for _ in range(2)]
    ops = {(r["op"], r["group"]) for r in engine.comm_report()}
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return losses, state, ops


@pytest.mark.parametrize("stage", STAGES)
def test_world_of_one_runs_real_collectives_and_stays_exact(monkeypatch: pytest.MonkeyPatch, stage: int) -> None:
    monkeypatch.setenv("SHARDWISE_DEVICE", "cpu")
    monkeypatch.delenv(COLLECTIVES_AT_ONE_ENV, raising=False)
    losses, state, ops = _train(stage)
    assert ops == set()                                 # a world of one communicates nothing
    monkeypatch.setenv(COLLECTIVES_AT_ONE_ENV, "1")
    losses_on, state_on, ops_on = _train(stage)
    expected = {0: {("all_reduce", "dp")}, 2: {("reduce_scatter", "dp"), ("all_gather", "dp")},
                3: {("reduce_scatter", "dp"), ("all_gather", "dp")}}[stage]
    assert expected <= ops_on and ("all_reduce", "dp:metrics") in ops_on
    assert losses_on == losses
    for k, v in state.items():
        assert torch.equal(state_on[k], v), k
