"""A checkpoint of any layout, consolidated on one process from its files alone (`shardwise.checkpoint.consolidate`), equals
what the ranks that wrote it assemble with `engine.save_16bit_model`: ZeRO-3 over 2 ranks (every parameter
sharded, and the small ones kept whole; with TP 2 and tied embeddings), TP 2 and a 2-stage pipeline of our
Llama-style model, ZeRO-2 in bf16.
One launch of 2 ranks trains each layout for two steps and writes both; the test process compares them exactly."""

from __future__ import annotations

import torch

from shardwise.testing import lm_pair, run_distributed, shard_global_batch, tiny_gpt, token_batches

SEQ, GLOBAL_BATCH = 16, 4
LLAMA = dict(positions="rotary", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2, d_ff=64)
LAYOUTS = {
    "zero3": ({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}, {}),
    "zero3_persistent_norms": ({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40}},
                               dict(LLAMA)),
    "tp2": ({"zero_optimization": {"stage": 1}, "tensor_parallel": {"size": 2}}, dict(LLAMA)),
    "zero3_tp2_tied": ({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                        "tensor_parallel": {"size": 2}}, dict(tie_embeddings=True)),
    "pp2": ({"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2}, dict(LLAMA)),
    "zero2_bf16": ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, dict(tie_embeddings=True)),
}


def _save_all(root: str) -> None:
    import shardwise
    torch.set_num_threads(1)
    for name, (extra, gpt) in LAYOUTS.items():
        model = tiny_gpt(seq_len=SEQ, **gpt)
        config = {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **extra}
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
        for batch in token_batches(2, GLOBAL_BATCH, SEQ + 1, seed=1):
            micro = shard_global_batch(batch, dp_size=engine.dp_size, dp_rank=engine.dp_rank,
                                       grad_accum=engine.gradient_accumulation_steps())
            engine.train_batch(iter([lm_pair(m) for m in micro]))
        engine.save_checkpoint(f"{root}/{name}/ckpt")
        engine.save_16bit_model(f"{root}/{name}", "whole.pt")
        engine.close()


def test_consolidated_checkpoint_equals_save_16bit_model(tmp_path, one_thread):
    from shardwise.checkpoint.consolidate import consolidated_state_dict
    run_distributed(_save_all, 2, args=(str(tmp_path),), timeout=300)
    for name, (_, gpt) in LAYOUTS.items():
        with torch.device("meta"):
            reference = tiny_gpt(seq_len=SEQ, seed=None, **gpt)
        whole = torch.load(tmp_path / name / "whole.pt", weights_only=True)
        merged = consolidated_state_dict(tmp_path / name / "ckpt", reference=reference)
        if name.startswith("zero3"):    # the weights came from the optimizer shards, not the placeholders
            # DeepSpeed's ZeRO-3 name: model states per dp rank
            module = torch.load(next((tmp_path / name / "ckpt").glob("*/zero_pp_rank_0_mp_rank_00_model_states.pt")),
                                weights_only=False)["module"]
            assert any(t.numel() == 0 for t in module.values()), name
        assert merged.keys() == whole.keys(), name
        for k, v in whole.items():
            assert merged[k].dtype == v.dtype and torch.equal(merged[k], v), f"{name}: {k}"
