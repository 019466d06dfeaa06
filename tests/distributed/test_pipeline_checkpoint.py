"""Checkpoints under pipeline parallelism (4 gloo ranks, one spawn).

- pp = 2 x dp = 2 with ZeRO-1 (1F1B): save after 2 global batches, train 2 more; a fresh engine loaded from the
  files takes exactly the same 2 steps (weights, optimizer shards, scheduler and counters restored).
- The stage files hold the full model's names, so the weights load into another layout with
  load_module_only=True: pp = 4 x dp = 1 and no pipeline at all (dp = 4) get the very same full model.
- The whole checkpoint (optimizer states and counters too) loads into another number of stages as well
  (test_reshard.py checks that training then continues exactly).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.testing import assert_close_lists, micro_steps, run_distributed, tiny_gpt, token_batches

SEQ, MICRO, GAS = 16, 2, 2


def _engine(pp: int, zero: int = 1):
    import shardwise
    dp = dist.get_world_size() // pp
    config = {"train_batch_size": MICRO * GAS * dp, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 3e-3}},
              "zero_optimization": {"stage": zero, "reduce_bucket_size": 3000}}
    if pp > 1:
        config["pipeline"] = {"stages": pp, "schedule": "1f1b"}
    model = tiny_gpt(n_layer=4, seq_len=SEQ)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _batches(engine, n: int, first: int) -> list[list]:
    """Steps first .. first + n - 1, each global batch from its own seed (the step): this rank's micro-batches."""
    dp = engine.dp_size
    rows = [token_batches(1, MICRO * GAS * dp, SEQ + 1, seed=step)[0] for step in range(first, first + n)]
    return micro_steps(rows, dp_size=dp, dp_rank=engine.dp_rank, grad_accum=GAS)


def _full_state(engine) -> dict:
    """The whole model's weights, on every rank (stages' parts all-gathered as objects)."""
    mine = engine.pipeline.module_state_dict(engine.module)       # full-model names, this rank's layers
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.detach().clone() for k, v in mine.items()})
    return {k: v for part in parts for k, v in part.items()}


def _ranks(root: str) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    engine = _engine(pp=2)
    out["first"] = [engine.train_batch(iter(b)) for b in _batches(engine, 2, 0)]
    engine.save_checkpoint(root)
    out["saved_state"] = _full_state(engine)
    engine.save_16bit_model(f"{root}/consolidated")       # one file of the whole model, from rank 0
    if dist.get_rank() == 0:
        out["consolidated"] = torch.load(f"{root}/consolidated/pytorch_model.bin", weights_only=True)
    out["files"] = sorted(p.name for p in Path(root, "global_step2").iterdir())
    out["more"] = [engine.train_batch(iter(b)) for b in _batches(engine, 2, 2)]
    engine.close()

    resumed = _engine(pp=2)
    resumed.load_checkpoint(root)
    out["steps_after_load"] = resumed.global_steps
    out["resumed"] = [resumed.train_batch(iter(b)) for b in _batches(resumed, 2, 2)]
    resumed.close()

    for pp in (4, 1):                                  # weights only, into other layouts
        other = _engine(pp=pp, zero=0)
        other.load_checkpoint(root, load_module_only=True)
        out[f"weights_pp{pp}"] = _full_state(other)
        other.load_checkpoint(root)                # optimizer states too, resharded to these stages
        out[f"steps_pp{pp}"] = other.global_steps
        other.close()
    return out


def test_pipeline_checkpoints_resume_exactly_and_reshard_weights(tmp_path: Path) -> None:
    results = run_distributed(_ranks, 4, args=(str(tmp_path),), timeout=300)
    ref = results[0]
    assert ref["files"] == sorted([f"mp_rank_{m:02d}_model_states.pt" for m in range(2)]
                                  + [f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt"
                                     for d in range(2) for m in range(2)] + ["shardwise_index.pt"])
    assert len(ref["saved_state"]) == len(tiny_gpt(n_layer=4, seq_len=SEQ).state_dict())
    assert ref["consolidated"].keys() == ref["saved_state"].keys()
    for k, v in ref["saved_state"].items():
        torch.testing.assert_close(ref["consolidated"][k], v, rtol=0, atol=0, msg=f"save_16bit_model {k}")
    for rank, res in enumerate(results):
        assert res["steps_after_load"] == 2
        assert_close_lists(res["resumed"], ref["more"], rtol=1e-6, what=f"rank {rank} resumed losses")
        assert res["first"] != res["more"]
        for pp in (4, 1):
            got = res[f"weights_pp{pp}"]
            assert got.keys() == ref["saved_state"].keys()
            for k, v in ref["saved_state"].items():
                torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=f"pp={pp} {k}")
            assert res[f"steps_pp{pp}"] == 2
