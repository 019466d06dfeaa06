"""ZeRO-Offload's overlapping copies on the CPU (streams absent, same arithmetic): each bucket's final gradient
shard is sent to its pinned host buffer during the boundary backward, the step casts it on the host, the masters
are cast on the host before going back; training is bitwise the run without offload."""

from __future__ import annotations

import pytest
import torch

from shardwise.parallel.zero.copies import CopyStream
from shardwise.testing import lm_pair, tiny_gpt, token_batches


def _run(stage: int, offload: bool, spy: list | None = None) -> tuple[dict, list]:
    import shardwise
    zero: dict = {"stage": stage, "reduce_bucket_size": 4000}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    engine, *_ = shardwise.initialize(model=tiny_gpt(n_layer=1), config=config)
    data = [lm_pair(b) for b in token_batches(6, 2, 17, seed=9)]
    observed = []
    for i, batch in enumerate(data):
        engine.backward(engine(batch))
        if spy is not None and i % 2 == 1:      # the boundary's backward is done, the step has not run
            observed.append((len(spy), all(b.host.pending for b in engine.updater.buckets)))
        engine.step()
        if spy is not None and i % 2 == 1:
            observed.append(any(b.host.pending for b in engine.updater.buckets))
    state = {k: v.detach().clone() for k, v in engine.dp_runtime.gathered_state_dict(engine.module).items()}
    if spy is not None:     # pinned staging, per bucket: the gradient shard sent [S] and the cast master [S], bf16
        staged = sum(2 * b.layout.shard_numel * b.param_flat.element_size() for b in engine.updater.buckets)
        observed.append((engine.memory_report()["host_staging"], staged))
    engine.close()
    return state, observed


@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_leave_per_bucket_during_backward_and_training_is_exact(monkeypatch: pytest.MonkeyPatch,
                                                                           stage: int) -> None:
    monkeypatch.setenv("SHARDWISE_DEVICE", "cpu")
    reference, _ = _run(stage, offload=False)
    sent: list = []
    real = CopyStream.to_host
    monkeypatch.setattr(CopyStream, "to_host", lambda self, dst, src: sent.append(src.numel()) or real(self, dst, src))
    state, observed = _run(stage, offload=True, spy=sent)
    buckets = observed[0][0]
    assert buckets > 1                                   # several buckets, each sent on its own
    assert observed[:-1] == [(buckets, True), False, (2 * buckets, True), False, (3 * buckets, True), False]
    reported, staged = observed[-1]
    assert reported == staged > 0
    for k, v in reference.items():
        assert torch.equal(state[k], v), k
