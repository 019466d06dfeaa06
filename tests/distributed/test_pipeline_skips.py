"""A step whose loss is inf while its gradients are finite is skipped under a pipeline as with one stage.

The loss: cross-entropy with the label's logit pushed to -inf by the labels themselves, so the loss is inf and
torch's gradients (softmax minus one-hot) are finite. One stage seeds its backward with nan for such a loss; the
pipeline's last stage must do the same, or the step is applied with the finite gradients. 2 ranks = 2 stages;
with nonfinite.skip_step false the same step is applied.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.testing import run_distributed

FEATURES, CLASSES, MICRO = 4, 3, 2


def _loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    targets, bias = labels               # [MICRO], [MICRO, CLASSES]: bias -inf at the target makes the loss inf
    return nn.functional.cross_entropy(logits + bias, targets)


def _micro_batches(poisoned: bool) -> list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for m in range(2):
        x = torch.randn(MICRO, FEATURES, generator=g)
        y = torch.randint(0, CLASSES, (MICRO,), generator=g)
        bias = torch.zeros(MICRO, CLASSES)
        if poisoned and m == 1:
            bias[0, y[0]] = float("-inf")
        out.append((x, (y, bias)))
    return out


def _run(skip_step: bool) -> dict:
    import shardwise
    torch.manual_seed(0)
    net = shardwise.pipe.PipelineModule(layers=[nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, CLASSES)],
                                        loss_fn=_loss, num_stages=2, partition_method="uniform")
    config = {"train_batch_size": 2 * MICRO, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "nonfinite": {"skip_step": skip_step}}
    engine, *_ = shardwise.initialize(model=net, model_parameters=net.parameters(), config=config)
    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = float(engine.train_batch(iter(_micro_batches(poisoned=True))))
    after_poisoned = [p.detach().clone() for p in engine.module.parameters()]
    record = {"loss": loss, "applied": engine.was_step_applied(), "skipped": engine.skipped_steps,
              "unchanged": all(torch.equal(a, b) for a, b in zip(before, after_poisoned)),
              "finite": all(torch.isfinite(p).all() for p in after_poisoned)}
    engine.train_batch(iter(_micro_batches(poisoned=False)))
    record["clean_applied"] = engine.was_step_applied()
    record["clean_moved"] = any(not torch.equal(a, p) for a, p in zip(after_poisoned, engine.module.parameters()))
    engine.destroy()
    return record


def _ranks() -> dict:
    return {"skip": _run(skip_step=True), "apply": _run(skip_step=False)}


def test_an_inf_loss_with_finite_gradients_is_skipped_on_every_stage() -> None:
    for stage, res in enumerate(run_distributed(_ranks, 2, timeout=120)):
        skip, apply = res["skip"], res["apply"]
        assert skip["loss"] == float("inf"), stage
        assert (skip["applied"], skip["skipped"], skip["unchanged"]) == (False, 1, True), (stage, skip)
        assert skip["clean_applied"] and skip["clean_moved"], (stage, skip)
        # switched off, the finite gradients are applied: the seed is torch's own
        assert (apply["applied"], apply["skipped"], apply["unchanged"], apply["finite"]) == (True, 0, False, True)
