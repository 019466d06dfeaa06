"""shardwise stage 0 equals DeepSpeed stage 0: the same config dict, the same tiny GPT from the same seed, the
same micro-batches, both engines driven by DeepSpeed's loop (`loss = engine(...)`, `engine.backward(loss)`,
`engine.step()`) inside the same two spawned gloo ranks.

DeepSpeed behaviours shardwise has to match (and that each case below exercises):
- "Adam" means AdamW: DeepSpeed builds its Adam with adam_w_mode=True (decoupled weight decay) unless
  `"adam_w_mode": false`; `"torch_adam": true` picks torch.optim.AdamW / Adam with torch's own defaults
  (we ask for it so DeepSpeed does not JIT-build FusedAdam, which needs a CUDA toolchain).
- "gradient_clipping" defaults to 1.0, not 0: a config without the key clips the global norm at 1.
- The loss is divided by gradient_accumulation_steps in backward; gradients are all-reduced only on the
  accumulation boundary and averaged over the data-parallel ranks (DeepSpeed multiplies by 1/dp after the
  sum, we divide by dp: both exact at dp = 2).
- The lr schedule advances once per optimizer step, after the step (WarmupLR / WarmupDecayLR are DeepSpeed's).
- bf16 at stage 0: bf16 parameters and gradients (all-reduced in bf16), fp32 master weights and optimizer.
DeepSpeed's clip computes the norm as sqrt(sum of per-tensor norms squared), torch as the norm of the
per-tensor norms: equal up to rounding, hence rtol 1e-5 rather than bitwise equality.

DeepSpeed runs on CPU with DS_ACCELERATOR=cpu (set before it is imported, in each rank). Its comm layer
sees torch.distributed already initialised and wraps the existing default group instead of creating one.
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import (
    assert_close_growing, assert_close_lists, assert_state_close, run_distributed, shard_global_batch, tiny_gpt,
    token_batches,
)

pytest.importorskip("deepspeed")

WORLD = 2
STEPS = 6
GLOBAL_BATCH = 8
SEQ = 16

_WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3,
                                          "warmup_type": "linear"}}
_DECAY = {"type": "WarmupDecayLR", "params": {"total_num_steps": STEPS, "warmup_min_lr": 1e-4,
                                              "warmup_max_lr": 3e-3, "warmup_num_steps": 2}}

# name -> config extras. Every case uses stage 0 with a small bucket (several buckets per step).
CASES: dict[str, dict] = {
    # gradient_clipping absent on purpose: DeepSpeed's default (1.0) must clip (asserted below).
    "sgd_momentum_default_clip": {"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}},
    "adam_is_adamw_accum_clip_warmup": {
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
        "gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "scheduler": _WARMUP},
    "adam_l2_mode": {
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "weight_decay": 0.1, "adam_w_mode": False,
                                                 "torch_adam": True}},
        "gradient_clipping": 0.0},
    "adamw_accum_decay": {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
        "gradient_accumulation_steps": 2, "gradient_clipping": 0.0, "scheduler": _DECAY},
    "sgd_accum_clip_decay": {
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "nesterov": True}},
        "gradient_accumulation_steps": 2, "gradient_clipping": 0.3, "scheduler": _DECAY},
}
# ZeRO stages 1 and 2 on the same configs. DeepSpeed accepts torch's SGD under ZeRO only with
# zero_allow_untested_optimizer (torch Adam/AdamW are on its tested list).
ZERO_CASES: dict[str, dict] = {
    f"zero{stage}_{name}": {**extra, "zero_allow_untested_optimizer": True,
                            "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}}
    for stage in (1, 2, 3)
    for name, extra in (("adam_is_adamw_accum_clip_warmup", CASES["adam_is_adamw_accum_clip_warmup"]),
                        ("sgd_accum_clip_decay", CASES["sgd_accum_clip_decay"]))
}
# bf16 at stage 0: DeepSpeed wraps the optimizer in FP16_UnfusedOptimizer, whose constructor takes one optimizer
# step with all-zero gradients to create the optimizer state (fp16/unfused_optimizer.py,
# initialize_optimizer_states; the fused FP16_Optimizer does the same). For SGD with momentum and no weight
# decay that step changes nothing (the momentum buffer starts at 0 and becomes g on the first real step, as
# torch's does). For Adam it does: the step count starts at 1, so the first real update is ~0.74 * lr instead
# of lr, and decoupled weight decay is applied once more to the fp32 masters. shardwise does not take that
# step; "bf16_adamw_ds_init_step" takes it on the shardwise side (`_take_deepspeed_init_step`) to show that
# this is the only difference.
BF16_CASES: dict[str, dict] = {
    "bf16_sgd_momentum_clip": {"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
                               "gradient_clipping": 1.0, "gradient_accumulation_steps": 2, "bf16": {"enabled": True}},
    "bf16_adamw_ds_init_step": {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01,
                                                                         "torch_adam": True}},
                                "gradient_clipping": 1.0, "bf16": {"enabled": True}},
}


def config_for(extra: dict) -> dict:
    cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000}, "steps_per_print": 10_000}
    cfg.update(copy.deepcopy(extra))
    return cfg


def global_batches(seed: int = 7) -> list[torch.Tensor]:
    """STEPS global batches [GLOBAL_BATCH, SEQ + 1] of tokens."""
    return token_batches(STEPS, GLOBAL_BATCH, SEQ + 1, seed=seed)


def _import_deepspeed():
    """DeepSpeed on CPU, quiet, without JIT-compiling its shared-memory all-reduce kernel: that kernel
    serves only `inference_all_reduce` (training all-reduces go through torch.distributed), and building it
    needs a C++ toolchain and ~20 s on a fresh machine."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


def _train(engine, model: torch.nn.Module, gas: int) -> dict:
    """DeepSpeed's loop over this rank's micro-batches; per micro-batch loss, per-step lr and (shardwise
    only: DeepSpeed's fp32 path does not keep it) the gradient norm seen by the clip."""
    world, rank = dist.get_world_size(), dist.get_rank()
    losses, lrs, norms = [], [], []
    for batch in global_batches():
        for micro in shard_global_batch(batch, dp_size=world, dp_rank=rank, grad_accum=gas):
            loss = engine(micro[:, :-1], micro[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        lrs.append(engine.get_lr()[0])
        norms.append(getattr(getattr(engine, "updater", None), "last_grad_norm", None))
    if hasattr(engine, "dp_runtime"):      # shardwise: gathered over dp under ZeRO-3, the module's own otherwise
        full = engine.dp_runtime.gathered_state_dict(engine.module, rank0_only=False)
    elif getattr(getattr(engine, "zero_optimization_stage", lambda: 0), "__call__")() == 3:  # DeepSpeed ZeRO-3
        full = engine._zero3_consolidated_16bit_state_dict()   # collective; the result is on rank 0 only
        box = [full if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        full = box[0]
    else:
        full = model.state_dict()
    state = {k: v.detach().float().clone() for k, v in full.items()}
    return {"losses": losses, "lrs": lrs, "norms": norms, "state": state}


def _take_deepspeed_init_step(engine) -> None:
    """What DeepSpeed's FP16_UnfusedOptimizer does at construction: one step of the wrapped optimizer on the
    fp32 masters with zero gradients, without copying the masters back into the bf16 model."""
    masters = engine.updater.masters
    for m in masters:
        m.grad = torch.zeros_like(m)
    engine.optimizer.step()
    for m in masters:
        m.grad = None


def _run_case(deepspeed, cfg: dict, ds_init_step: bool = False) -> dict:
    import shardwise
    gas = cfg["gradient_accumulation_steps"]
    model = tiny_gpt(seq_len=SEQ)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))
    if ds_init_step:
        _take_deepspeed_init_step(engine)
    ours = _train(engine, model, gas)
    engine.close()

    ds_model = tiny_gpt(seq_len=SEQ)
    linear = torch.nn.functional.linear
    try:
        ds_engine, *_ = deepspeed.initialize(model=ds_model, model_parameters=ds_model.parameters(),
                                             config=copy.deepcopy(cfg))
        theirs = _train(ds_engine, ds_model, gas)
    finally:
        # DeepSpeed's ZeRO-3 swaps torch.nn.functional.linear for its own autograd function and leaves it there
        # ("this will persist unless manually reset"). Every later case, shardwise's side included, would run
        # its Linear layers through it, which rounds bf16 gradients differently: put torch's back.
        torch.nn.functional.linear = linear
    theirs["optimizer"] = type(ds_engine.optimizer).__name__
    theirs["basic_optimizer"] = type(ds_engine.basic_optimizer).__name__
    return {"shardwise": ours, "deepspeed": theirs}


def _run_cases(extras: dict[str, dict]) -> dict:
    torch.set_num_threads(1)
    deepspeed = _import_deepspeed()
    return {name: _run_case(deepspeed, config_for(extra), ds_init_step=name.endswith("ds_init_step"))
            for name, extra in extras.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """Every case in one pair of spawned ranks (importing DeepSpeed costs seconds per process)."""
    return run_distributed(_run_cases, WORLD, args=({**CASES, **ZERO_CASES, **BF16_CASES},), timeout=400)


@pytest.mark.parametrize("name", list(CASES) + list(ZERO_CASES))
def test_fp32_matches_deepspeed(results: list[dict], name: str) -> None:
    for rank, res in enumerate(results):
        ours, theirs = res[name]["shardwise"], res[name]["deepspeed"]
        assert_close_lists(ours["losses"], theirs["losses"], rtol=1e-5, what=f"{name} rank {rank} losses")
        assert_close_lists(ours["lrs"], theirs["lrs"], rtol=1e-12, what=f"{name} rank {rank} lr")
        assert_state_close(ours["state"], theirs["state"], what=f"{name} rank {rank}", rtol=1e-5, atol=1e-5)
    # both ranks hold the same model (the all-reduce really averaged)
    assert_state_close(results[1][name]["shardwise"]["state"], results[0][name]["shardwise"]["state"],
                       what=f"{name} rank 1 vs rank 0", rtol=0.0, atol=0.0)


def test_deepspeed_took_the_plain_torch_path(results: list[dict]) -> None:
    """Guards the comparison: DeepSpeed stepped torch's own optimizer (no fused kernel, no wrapper)."""
    res = results[0]
    assert res["sgd_momentum_default_clip"]["deepspeed"]["optimizer"] == "SGD"
    assert res["adam_is_adamw_accum_clip_warmup"]["deepspeed"]["optimizer"] == "AdamW"
    assert res["adam_l2_mode"]["deepspeed"]["optimizer"] == "Adam"


def test_default_gradient_clipping_is_active(results: list[dict]) -> None:
    """Without "gradient_clipping" both engines clip at 1.0. The first step's gradient norm is above 1 (so
    clipping changes that step), hence the parameter parity above holds only if DeepSpeed clipped too."""
    norms = results[0]["sgd_momentum_default_clip"]["shardwise"]["norms"]
    assert all(n is not None for n in norms), "shardwise did not clip without a gradient_clipping key"
    assert norms[0] > 1.0


# bf16 tolerances, from bf16's machine epsilon: eps = 2**-7 (8 significant bits).
# Losses: both engines run the same bf16 forward on the same bf16 weights, so before the first update their
# losses agree bit for bit. An update can then differ only by rounding: the bf16 gradient sum over the ranks
# and the fp32 clip norm are reduced in another order, which moves an fp32 master weight by ~1e-7 relative and
# so, now and then, rounds its bf16 copy to the neighbouring value (a relative change of at most eps). Few
# weights flip, each moves the loss by a small fraction of eps, and the flips add up over the updates. So the
# loss of a micro-batch that follows n updates may differ by rtol = n * c * eps with c = 1/64 (1.2e-4 per
# update), ~40x the largest difference seen (1.6e-5 after 5 updates). Real errors are far larger: an lr 10% off
# moves the loss by 2e-4 after one update, a doubled or halved lr or a skipped step by 5e-4 to 3e-3.
# Parameters: an fp32 master differs from the other engine's by the rounding of its updates, far less than a bf16
# ulp of a weight of typical size, so the bf16 copies differ by at most one ulp, <= eps * |w|. Near zero a ulp
# is tiny while the masters' difference is set by the updates, not by the weight: there we allow one ulp of a
# weight of the init's scale, eps * init_std (1.6e-4; the largest such difference seen is 4e-6).
BF16_EPS = torch.finfo(torch.bfloat16).eps
BF16_LOSS_RTOL_PER_UPDATE = BF16_EPS / 64
INIT_STD = 0.02                                   # GPTConfig.init_std: the tiny GPT's weights are N(0, 0.02)


@pytest.mark.parametrize("name", list(BF16_CASES))
def test_bf16_matches_deepspeed(results: list[dict], name: str) -> None:
    gas = config_for(BF16_CASES[name])["gradient_accumulation_steps"]
    for rank, res in enumerate(results):
        ours, theirs = res[name]["shardwise"], res[name]["deepspeed"]
        # DeepSpeed's stage-0 bf16 path for a non-fused optimizer: fp32 masters, no loss scale for bf16
        assert theirs["optimizer"] == "FP16_UnfusedOptimizer"
        # micro-batch i follows i // gas updates
        assert_close_growing(ours["losses"], theirs["losses"], rtol_per_step=BF16_LOSS_RTOL_PER_UPDATE,
                             steps=[i // gas for i in range(STEPS * gas)], what=f"{name} rank {rank} losses")
        assert_state_close(ours["state"], theirs["state"], what=f"{name} rank {rank}", rtol=BF16_EPS,
                           atol=BF16_EPS * INIT_STD)
