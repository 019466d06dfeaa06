"""Third-party models train under every ZeRO stage landed, equal to single-process training: a Hugging Face
Llama built from a small config (no download), driven by the DeepSpeed loop."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import assert_close_lists, run_distributed, shard_global_batch

pytest.importorskip("transformers")

STEPS, GLOBAL_BATCH, SEQ = 4, 8, 16
STAGES = [0, 1, 2]


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(STEPS)]


def reference() -> tuple[list[float], dict]:
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for b in batches():
        opt.zero_grad()
        loss = model(input_ids=b, labels=b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_all() -> dict:
    import shardwise
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for stage in STAGES:
        model = llama()
        cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
               "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000}}
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = []
        for b in batches():
            (mine,) = shard_global_batch(b, dp_size=world, dp_rank=rank, grad_accum=1)
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            t = loss.detach().reshape(1).clone()
            dist.all_reduce(t)
            losses.append(float(t) / world)
        out[stage] = {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        engine.close()
    return out


def test_hf_llama_matches_single_process_under_zero_stages():
    ref_losses, ref_state = reference()
    results = run_distributed(_train_all, 2, timeout=300)
    for stage in STAGES:
        for rank, res in enumerate(results):
            got = res[stage]
            assert_close_lists(got["losses"], ref_losses, rtol=1e-5, what=f"stage {stage} rank {rank}")
            for k, v in ref_state.items():
                if k.endswith("k_proj.bias"):
                    continue
                torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{stage} {k}: {m}")
