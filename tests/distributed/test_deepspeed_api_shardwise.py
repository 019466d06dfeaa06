"""DeepSpeed's script API where shardwise answers alone: the refusals (no_sync under ZeRO-2, a step inside
no_sync, a batch size that is not a multiple, set_train_batch_size mid-batch or under a pipeline),
empty_partition_cache freeing every gathered unit, bf16 masters, TP slices and frozen parameters through
`shardwise.utils`. The values compared with DeepSpeed itself are `test_deepspeed_api.py`'s."""

from __future__ import annotations

import copy

import torch

from shardwise.testing import run_distributed, tiny_gpt
from test_deepspeed_api import SEQ, WORLD, ZERO1, ZERO3, _batches


def _shardwise_only() -> dict:
    """Refusals and kinds DeepSpeed shares but reports with asserts: no_sync under ZeRO-2, step inside
    no_sync, a batch size that is not a multiple; empty_partition_cache frees every gathered unit; bf16."""
    import shardwise
    from shardwise.parallel.tensor_parallel.layers import is_tensor_parallel_shard
    out = {}
    adamw = {"optimizer": copy.deepcopy(ZERO3["optimizer"])}
    model = tiny_gpt(seq_len=SEQ)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config={**copy.deepcopy(ZERO1), **adamw, "zero_optimization": {"stage": 2}})
    out["no_sync_stage2"] = _refusal(lambda: engine.no_sync().__enter__())
    out["bad_batch"] = _refusal(lambda: engine.set_train_batch_size(6))
    try:
        engine.set_train_batch_size(6)
    except ValueError:                          # what DeepSpeed raises, for scripts that catch it
        out["bad_batch_is_value_error"] = True
    out["norm_before_step"] = engine.get_global_grad_norm()
    engine.destroy()

    model = tiny_gpt(seq_len=SEQ)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config={**copy.deepcopy(ZERO1), **adamw, "bf16": {"enabled": True},
                                              "zero_optimization": {"stage": 0}})
    out["bf16"] = (engine.bfloat16_enabled(), engine.fp16_enabled(), engine.zero_optimization_stage())
    rows = _batches(1)[0][:2]
    engine.backward(engine(rows[:, :-1], rows[:, 1:]))
    out["bf16_grad_is_grad"] = all(torch.equal(shardwise.utils.safe_get_full_grad(p), p.grad)
                                   for p in model.parameters())
    engine.step()
    masters = [shardwise.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    # the fp32 master, which the bf16 weight is rounded from (and differs from, after an update)
    out["bf16_masters"] = (all(m.dtype == torch.float32 for m in masters),
                           all(torch.equal(m.to(torch.bfloat16), p) for m, p in zip(masters, model.parameters())),
                           any(not torch.equal(m, p.float()) for m, p in zip(masters, model.parameters())))
    with engine.no_sync():
        out["step_in_no_sync"] = _refusal(engine.step)
    engine.destroy()

    model = tiny_gpt(seq_len=SEQ)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(ZERO3))
    for u in engine.dp_runtime.units:
        engine.dp_runtime.gather_unit(u)
    out["live_gathered"] = engine.dp_runtime.live_numel
    engine.empty_partition_cache()
    out["live_emptied"] = engine.dp_runtime.live_numel
    engine.destroy()

    # tensor parallelism (2 ranks: tp 2, dp 1) under ZeRO-1: a parameter's value is this rank's TP slice
    model = tiny_gpt(seq_len=SEQ)
    frozen = model.embed.pos.weight
    frozen.requires_grad_(False)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config={**copy.deepcopy(ZERO1), **adamw, "train_batch_size": 2,
                                              "tensor_parallel": {"size": 2}})
    engine.backward(engine(rows[:, :-1], rows[:, 1:]))
    trained = [p for p in model.parameters() if p.requires_grad]
    grads = [shardwise.utils.safe_get_full_grad(p) for p in trained]
    out["tp_grads"] = all(g is not None and g.shape == p.shape for g, p in zip(grads, trained))
    engine.step()
    out["tp_values"] = all(torch.equal(shardwise.utils.safe_get_full_fp32_param(p), p) for p in trained)
    out["tp_sliced"] = sum(is_tensor_parallel_shard(p) for p in trained)
    out["frozen"] = shardwise.utils.safe_get_full_fp32_param(frozen)
    engine.destroy()

    # set_train_batch_size: refused mid-batch, and under a pipeline whose schedule fixes the micro-batches
    model = tiny_gpt(seq_len=SEQ)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config={**copy.deepcopy(ZERO1), **adamw, "gradient_accumulation_steps": 2,
                                              "train_batch_size": 8})
    engine.backward(engine(rows[:, :-1], rows[:, 1:]))
    engine.step()                                   # micro-batch 1 of 2
    out["mid_batch"] = _refusal(lambda: engine.set_train_batch_size(4))
    engine.destroy()
    model = tiny_gpt(seq_len=SEQ)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config={**copy.deepcopy(ZERO1), **adamw, "train_batch_size": 2,
                                              "pipeline": {"stages": 2}})
    out["pipeline_batch"] = _refusal(lambda: engine.set_train_batch_size(4))
    engine.set_train_batch_size(2)                  # the same accumulation: nothing to refuse
    engine.destroy()
    return out


def _refusal(call) -> str:
    from shardwise.errors import UserError
    try:
        call()
    except UserError as e:
        return str(e)
    return "accepted"


def test_shardwise_refusals_and_cache() -> None:
    only = run_distributed(_shardwise_only, WORLD, timeout=300)[0]
    assert "ZeRO stage 2" in only["no_sync_stage2"]
    assert "multiple of train_micro_batch_size_per_gpu 2 * data-parallel size 2" in only["bad_batch"]
    assert only["bad_batch_is_value_error"]
    assert "inside engine.no_sync()" in only["step_in_no_sync"]
    assert only["norm_before_step"] is None
    assert only["bf16"] == (True, False, 0)
    assert only["live_gathered"] > 0 and only["live_emptied"] == 0
    assert only["bf16_grad_is_grad"] and only["bf16_masters"] == (True, True, True)
    assert only["tp_grads"] and only["tp_values"] and only["tp_sliced"] > 0
    assert only["frozen"] is None          # not trained by the engine: None, as in DeepSpeed
    assert "in the middle of a global batch" in only["mid_batch"]
    assert "pipeline schedule was built for 1" in only["pipeline_batch"]
