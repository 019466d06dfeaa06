"""Data parallelism equals single-process training: same seed, same global batch, 5 steps, at 2 and 4
ranks, with and without gradient accumulation, with clipping, with ring and shared-memory all-reduce; and equals
torch DDP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import (
    assert_close_lists, assert_state_close, lm_pair, mean_over_ranks, micro_steps, reference_train, run_distributed,
    shard_global_batch, state_copy, tiny_gpt, token_batches,
)

STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16

CASES = {
    "adamw": dict(optimizer={"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}, gas=1, clip=0.0,
                  all_reduce="backend"),
    # prescale_gradients: each gradient divided by the dp size in its hook, before the sum
    "sgd_accum_clip": dict(optimizer={"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, gas=2, clip=0.3,
                           all_reduce="backend", prescale=True),
    "adam_ring_accum_clip": dict(optimizer={"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}}, gas=2,
                                 clip=0.5, all_reduce="ring"),
    # shared-memory all-reduce (the buckets live in /dev/shm), with accumulation and clipping
    "adamw_shm_accum_clip": dict(optimizer={"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}, gas=2,
                                 clip=0.5, all_reduce="shm"),
}


def global_batches(seed: int = 7) -> list[torch.Tensor]:
    """STEPS global batches [GLOBAL_BATCH, SEQ + 1] of tokens."""
    return token_batches(STEPS, GLOBAL_BATCH, SEQ + 1, seed=seed)


def ds_config(case: dict, world: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": case["clip"],
        "optimizer": case["optimizer"],
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000},   # several buckets
        "communication": {"all_reduce": case["all_reduce"]},
        "prescale_gradients": case.get("prescale", False),
    }


def reference_optimizer(spec: dict, params) -> torch.optim.Optimizer:
    p = {k: v for k, v in spec["params"].items() if k != "torch_adam"}
    if spec["type"] in ("AdamW", "Adam"):      # DeepSpeed's "Adam" is decoupled (adam_w_mode=True)
        return torch.optim.AdamW(params, **p)
    return torch.optim.SGD(params, **p)


def run_reference(case: dict) -> tuple[list[float], dict]:
    model = tiny_gpt(seq_len=SEQ)
    opt = reference_optimizer(case["optimizer"], model.parameters())
    losses = reference_train(model, opt, micro_steps(global_batches(), grad_accum=case["gas"]),
                             loss_fn=lambda m, mb: m(*mb), clip=case["clip"] or None)
    return losses, state_copy(model)


def _train_cases(case_names: list[str]) -> dict:
    import shardwise
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name in case_names:
        case = CASES[name]
        model = tiny_gpt(seq_len=SEQ)
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(case, world))
        losses, overlapped, boundary_only = [], [], True
        for b in global_batches():
            micro = shard_global_batch(b, dp_size=world, dp_rank=rank, grad_accum=case["gas"])
            total = 0.0
            for k, mb in enumerate(micro):
                loss = engine(lm_pair(mb))
                engine.backward(loss)
                if not engine.is_gradient_accumulation_boundary():
                    boundary_only &= not any(s.group == "dp" for s in engine.ledger.summary(engine.global_steps))
                else:
                    overlapped.append(engine.dp_runtime.launch_log[0] < sum(1 for _ in model.parameters()))
                engine.step()
                total += float(loss.detach())
            losses.append(mean_over_ranks(total / len(micro)))
        out[name] = {"losses": losses, "state": state_copy(model),
                     "comm": engine.comm_report(), "overlapped": overlapped, "boundary_only": boundary_only,
                     "num_params": sum(p.numel() for p in model.parameters())}
        engine.close()
    # torch DDP on the same data, for the first case family that DDP expresses directly
    out["ddp"] = _train_ddp("sgd_accum_clip")
    return out


def _train_ddp(name: str) -> dict:
    """torch DDP's own loop (no_sync on all but the last micro-batch). Not `reference_train`: it runs on the
    ranks, each on its own share of the batch, and the point is DDP's gradient averaging, not plain torch."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    case = CASES[name]
    world, rank = dist.get_world_size(), dist.get_rank()
    model = DDP(tiny_gpt(seq_len=SEQ), bucket_cap_mb=0.01)
    opt = reference_optimizer(case["optimizer"], model.parameters())
    losses = []
    for b in global_batches():
        micro = shard_global_batch(b, dp_size=world, dp_rank=rank, grad_accum=case["gas"])
        opt.zero_grad()
        total = 0.0
        for k, mb in enumerate(micro):
            if k < len(micro) - 1:
                with model.no_sync():
                    loss = model(*lm_pair(mb))
                    (loss / len(micro)).backward()
            else:
                loss = model(*lm_pair(mb))
                (loss / len(micro)).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        opt.step()
        losses.append(mean_over_ranks(total / len(micro)))
    return {"losses": losses, "state": state_copy(model.module)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_dp_matches_single_process_and_ddp(world_size):
    names = list(CASES)
    results = run_distributed(_train_cases, world_size, args=(names,), timeout=300)
    for name in names:
        ref_losses, ref_state = run_reference(CASES[name])
        for rank, res in enumerate(results):
            got = res[name]
            assert_close_lists(got["losses"], ref_losses, rtol=1e-5, what=f"{name} rank {rank} losses")
            # parameters: rtol = atol = 1e-5; under Adam, the k_proj biases are skipped (assert_state_close)
            assert_state_close(got["state"], ref_state, what=f"{name} rank {rank}",
                               adam="Adam" in CASES[name]["optimizer"]["type"])
            assert got["boundary_only"], f"{name}: communication on a non-boundary micro-batch"
            assert all(got["overlapped"]), f"{name}: first bucket launched only after backward ended"
            # one step's gradient traffic: every fp32 gradient once (all-reduce of the full gradient)
            grad_ops = [c for c in got["comm"] if c["group"] == "dp"]
            assert sum(c["bytes"] for c in grad_ops) == 4 * got["num_params"]
            expected_op = {"ring": "ring_all_reduce", "shm": "shm_all_reduce"}.get(CASES[name]["all_reduce"],
                                                                                "all_reduce")
            assert {c["op"] for c in grad_ops} == {expected_op}
            assert sum(c["count"] for c in grad_ops) > 1, "expected several buckets"
    for rank, res in enumerate(results):     # DDP equals shardwise, which equals the reference (above)
        assert_close_lists(res["ddp"]["losses"], res["sgd_accum_clip"]["losses"], rtol=1e-5, what="vs DDP")
        assert_state_close(res["sgd_accum_clip"]["state"], res["ddp"]["state"], what=f"vs DDP rank {rank}")
