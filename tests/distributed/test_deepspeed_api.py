"""DeepSpeed's script-level API: one script, written against `import shardwise as deepspeed`, run at 2 ranks with
shardwise and with real DeepSpeed (DS_ACCELERATOR=cpu) on the same model, data and config; the values both
report must match.

Three scripts:
- ZeRO-0 and ZeRO-1, gradient_accumulation_steps 1, no clipping (get_global_grad_norm without a clip), a client FusedAdam
  (DeepSpeed's side: torch's AdamW, which is what DeepSpeed's FusedAdam computes; its CUDA kernel cannot build
  here): one global batch accumulated with no_sync, one plain, then set_train_batch_size doubles the global batch
  (accumulation 1 -> 2) for two more.
- ZeRO-3 with zero.Init(module=model) on a model built whole (shards on the host): rank 0's weights on every rank,
  then the same losses.
- ZeRO-3 under zero.Init: the weights read with GatheredParameters, then every weight written on rank 0
  (modifier_rank=0; rank 1 writes garbage that must not survive) before initialize, as scripts load weights;
  accumulation 2, clipping; one weight changed again with modifier_rank=0 after two steps (shardwise's fp32
  optimizer steps the shards, so the change stays; DeepSpeed's steps a separate fp32 copy, which overwrites it:
  the one difference, asserted); safe_get_full_grad before the last step, safe_get_full_fp32_param after it; the
  partition cache emptied mid-run. The final fp32 parameters equal the single-process reference's. Only
  shardwise's zero.Init build is compared with a direct build: DeepSpeed's partitions each submodule as its
  constructor returns, so the GPT's closing init_weights() runs on empty partitions there.

Tolerances. Losses and fp32 parameters: rtol 1e-5, as the other fp32 parity tests. Gradient norms: each engine
sums squares in its own order (DeepSpeed per tensor in fp32, shardwise in float64) and reduces over ranks in its
own order. torch's norms sum a tensor blockwise (rounding growing like log2 of its size) and the per-tensor results
are then added one by one, so one step's norm agrees to (log2(largest tensor) + tensor count) * eps32 (6e-6 for the
tiny GPT); each step after the first adds the weights' own drift, one such bound per step. Full gradients: the
same bound times the steps behind them, relative to each tensor's largest element.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os

import pytest
import torch
import torch.distributed as dist

from test_deepspeed_parity import _import_deepspeed
from shardwise.testing import (
    assert_close_growing, assert_close_lists, assert_state_close, micro_steps, reference_train, run_distributed,
    shard_global_batch, tiny_gpt, token_batches,
)

WORLD = 2
SEQ = 16
SCALED = "blocks.0.mlp.fc_in.weight"     # the weight the ZeRO-3 script changes on rank 0

ZERO1 = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "steps_per_print": 10_000,
         "zero_optimization": {"stage": 1, "reduce_bucket_size": 3000}}
ZERO0 = {**ZERO1, "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000}}
ZERO3 = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "steps_per_print": 10_000,
         "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100, "reduce_bucket_size": 3000}}
ZERO3_STEPS = 3
RESCALED, RESCALE_AT = "blocks.1.attn.o_proj.weight", 2    # scaled by 0.75 on rank 0 before that step


def _batches(count: int) -> list[torch.Tensor]:
    return token_batches(count, 8, SEQ + 1, seed=11)


# -- the scripts: `ds` is shardwise or deepspeed ---------------------------------------------------------

def _args(ds, config_path: str) -> argparse.Namespace:
    parser = ds.add_config_arguments(argparse.ArgumentParser())
    return parser.parse_args(["--deepspeed", "--deepspeed_config", config_path])


def _comm_facts(ds) -> dict:
    ds.init_distributed()
    ds.comm.init_distributed(dist_backend="gloo")      # both are idempotent
    total = torch.ones(1) * (ds.comm.get_rank() + 1)
    ds.comm.all_reduce(total)
    ds.comm.barrier()
    return {"initialized": ds.comm.is_initialized(), "rank": ds.comm.get_rank(),
            "world": ds.comm.get_world_size(), "local_rank": ds.comm.get_local_rank(), "sum": float(total)}


def _engine_facts(engine) -> dict:
    return {"local_rank": engine.local_rank, "global_rank": engine.global_rank,
            "train_batch_size": engine.train_batch_size(),
            "micro": engine.train_micro_batch_size_per_gpu(), "gas": engine.gradient_accumulation_steps(),
            "stage": int(engine.zero_optimization_stage()), "fp16": engine.fp16_enabled(),
            "bf16": engine.bfloat16_enabled()}


def _dp_script(ds, config_path: str, adam) -> dict:
    out = {"comm": _comm_facts(ds)}
    rank, world = ds.comm.get_rank(), ds.comm.get_world_size()
    model = tiny_gpt(seq_len=SEQ)
    args = _args(ds, config_path)
    args.local_rank = -1                # a script's own --local_rank flag: initialize sets it from the launcher
    engine, *_ = ds.initialize(args=args, model=model, model_parameters=model.parameters(),
                               optimizer=adam(model.parameters()))
    out["before"] = dict(_engine_facts(engine), args_local_rank=args.local_rank)
    losses, norms = [], []

    def forward_backward(rows: torch.Tensor) -> None:
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        losses.append(float(loss.detach()))

    batches = _batches(4)
    first, second = shard_global_batch(batches[0], dp_size=world, dp_rank=rank, grad_accum=2)
    with engine.no_sync():             # accumulate locally; the next backward on the boundary reduces the sum
        forward_backward(first)
    forward_backward(second)
    engine.step()
    norms.append(engine.get_global_grad_norm())
    for rows in shard_global_batch(batches[1][:4], dp_size=world, dp_rank=rank, grad_accum=1):
        forward_backward(rows)
        engine.step()
    norms.append(engine.get_global_grad_norm())
    engine.set_train_batch_size(8)
    out["after"] = _engine_facts(engine)
    for batch in batches[2:]:
        for rows in shard_global_batch(batch, dp_size=world, dp_rank=rank, grad_accum=2):
            forward_backward(rows)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    # None for every parameter from DeepSpeed at stage 0 (no fp32 mapping there); the weights themselves are whole
    out["fp32"] = {n: ds.utils.safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return dict(out, losses=losses, norms=norms)


def _zero3_script(ds, config_path: str, config: dict) -> dict:
    out = {"comm": _comm_facts(ds)}
    rank, world = ds.comm.get_rank(), ds.comm.get_world_size()
    torch.manual_seed(1234)
    with ds.zero.Init(config_dict_or_path=config):
        model = tiny_gpt(seq_len=SEQ, seed=None)
    named = dict(model.named_parameters())
    with ds.zero.GatheredParameters(list(named.values())):
        out["built"] = {n: p.detach().clone() for n, p in named.items()}
    reference = tiny_gpt(seq_len=SEQ).state_dict()
    with ds.zero.GatheredParameters(list(named.values()), modifier_rank=0):
        for n, p in named.items():
            if rank == 0:
                p.data.copy_(reference[n] * (0.5 if n == SCALED else 1.0))
            else:
                p.data.fill_(7.0)          # overwritten by rank 0's values on exit
    with ds.zero.GatheredParameters(list(named.values())):
        out["loaded"] = {n: p.detach().clone() for n, p in named.items()}
    engine, *_ = ds.initialize(args=_args(ds, config_path), model=model, model_parameters=model.parameters())
    out["facts"] = _engine_facts(engine)
    gas = engine.gradient_accumulation_steps()
    losses, norms = [], []
    for step, batch in enumerate(_batches(ZERO3_STEPS)):
        if step == 1:
            engine.empty_partition_cache()
        if step == RESCALE_AT:     # a change after initialize: fp32 shards are what both optimizers step
            with ds.zero.GatheredParameters([named[RESCALED]], modifier_rank=0):
                named[RESCALED].data.mul_(0.75 if rank == 0 else 0.0)
        for k, rows in enumerate(shard_global_batch(batch, dp_size=world, dp_rank=rank, grad_accum=gas)):
            loss = engine(rows[:, :-1], rows[:, 1:])
            engine.backward(loss)
            losses.append(float(loss.detach()))
            if step == ZERO3_STEPS - 1 and k == gas - 1:    # the boundary's gradients, before step() uses them
                out["grads"] = {n: ds.utils.safe_get_full_grad(p).clone() for n, p in named.items()}
            engine.step()
        norms.append(engine.get_global_grad_norm())
    out["fp32"] = {n: ds.utils.safe_get_full_fp32_param(p).clone() for n, p in named.items()}
    with ds.zero.GatheredParameters(list(named.values())):
        out["trained"] = {n: p.detach().clone() for n, p in named.items()}
    engine.destroy()
    return dict(out, losses=losses, norms=norms)


def _zero3_module_script(ds, config: dict) -> dict:
    """zero.Init(module=...) on a model built whole, each rank from its own seed (rank 0's weights must win), the
    shards kept in host memory (remote_device "cpu", pinned where CUDA exists); then trained."""
    rank, world = ds.comm.get_rank(), ds.comm.get_world_size()
    model = tiny_gpt(seq_len=SEQ, seed=1234 + rank)
    ds.zero.Init(module=model, config_dict_or_path=copy.deepcopy(config), remote_device="cpu", pin_memory=True)
    named = dict(model.named_parameters())
    with ds.zero.GatheredParameters(list(named.values())):
        built = {n: p.detach().clone() for n, p in named.items()}
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))
    losses = []
    for batch in _batches(2):
        for rows in shard_global_batch(batch, dp_size=world, dp_rank=rank,
                                       grad_accum=engine.gradient_accumulation_steps()):
            loss = engine(rows[:, :-1], rows[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    engine.destroy()
    return {"built": built, "losses": losses}


def _ranks(tmp: str) -> dict:
    torch.set_num_threads(1)
    import shardwise
    from shardwise.ops.adam import FusedAdam
    paths = {}
    for name, cfg in (("zero0", ZERO0), ("zero1", ZERO1), ("zero3", ZERO3)):
        paths[name] = os.path.join(tmp, f"{name}.json")
        if dist.get_rank() == 0:
            with open(paths[name], "w") as f:
                json.dump(cfg, f)
    dist.barrier()
    ours = {name: _dp_script(shardwise, paths[name],
                             lambda ps: FusedAdam(ps, lr=3e-3, weight_decay=0.1, adam_w_mode=True))
            for name in ("zero0", "zero1")}
    ours["zero3"] = _zero3_script(shardwise, paths["zero3"], copy.deepcopy(ZERO3))
    ours["zero3_module"] = _zero3_module_script(shardwise, ZERO3)
    deepspeed = _import_deepspeed()
    linear = torch.nn.functional.linear
    try:
        theirs = {name: _dp_script(deepspeed, paths[name], lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1))
                  for name in ("zero0", "zero1")}
        theirs["zero3"] = _zero3_script(deepspeed, paths["zero3"], copy.deepcopy(ZERO3))
        theirs["zero3_module"] = _zero3_module_script(deepspeed, ZERO3)
    finally:
        torch.nn.functional.linear = linear       # DeepSpeed's ZeRO-3 leaves its own in place
    return {"shardwise": ours, "deepspeed": theirs}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_ranks, WORLD, args=(str(tmp_path_factory.mktemp("ds_api")),), timeout=400)


def _norm_rtol() -> float:
    """The rounding bound of one step's gradient norm (module docstring), from fp32's eps and the model."""
    params = list(tiny_gpt(seq_len=SEQ).parameters())
    largest = max(p.numel() for p in params)
    return (math.log2(largest) + len(params)) * torch.finfo(torch.float32).eps


# -- checks ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["zero0", "zero1", "zero3"])
def test_comm_and_engine_facts_match(results: list[dict], script: str) -> None:
    for rank, res in enumerate(results):
        ours, theirs = res["shardwise"][script], res["deepspeed"][script]
        assert ours["comm"] == theirs["comm"] == {"initialized": True, "rank": rank, "world": WORLD,
                                                  "local_rank": rank, "sum": 3.0}
        for key in ("before", "after", "facts"):
            if key in theirs:
                assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    facts = results[0]["shardwise"]
    assert facts["zero1"]["before"] == {"local_rank": 0, "global_rank": 0, "train_batch_size": 4, "micro": 2,
                                        "gas": 1, "stage": 1, "fp16": False, "bf16": False, "args_local_rank": 0}
    assert facts["zero1"]["after"]["train_batch_size"] == 8 and facts["zero1"]["after"]["gas"] == 2
    assert facts["zero0"]["before"]["stage"] == 0
    assert facts["zero3"]["facts"]["stage"] == 3 and facts["zero3"]["facts"]["gas"] == 2


@pytest.mark.parametrize("script", ["zero0", "zero1", "zero3"])
def test_losses_and_grad_norms_match_deepspeed(results: list[dict], script: str) -> None:
    rtol = _norm_rtol()
    for rank, res in enumerate(results):
        ours, theirs = res["shardwise"][script], res["deepspeed"][script]
        assert_close_lists(ours["losses"], theirs["losses"], rtol=1e-5, what=f"{script} rank {rank} losses")
        if script == "zero0":
            # DeepSpeed's stage-0 fp32 path has no optimizer wrapper, hence no norm and no fp32 mapping (None);
            # shardwise reports both: the norm is the one DeepSpeed's ZeRO-1 reports on the same run.
            assert theirs["norms"] == [None] * len(theirs["norms"])
            assert all(v is None for v in theirs["fp32"].values())
            theirs = dict(theirs, norms=res["deepspeed"]["zero1"]["norms"], fp32=theirs["params"])
        assert all(n is not None for n in theirs["norms"]), theirs["norms"]
        assert_close_growing(ours["norms"], theirs["norms"], rtol_per_step=rtol,
                             steps=list(range(1, len(theirs["norms"]) + 1)), what=f"{script} rank {rank} norms")
        if script == "zero3":
            # the one deliberate difference: DeepSpeed's optimizer stepped its own fp32 copy, which never saw the
            # change GatheredParameters made after initialize (its forward did: the losses above agree)
            assert not torch.allclose(ours["fp32"][RESCALED], theirs["fp32"][RESCALED], rtol=1e-3, atol=1e-4)
            ours, theirs = (dict(side, fp32={n: v for n, v in side["fp32"].items() if n != RESCALED})
                            for side in (ours, theirs))
        assert_state_close(ours["fp32"], theirs["fp32"], what=f"{script} rank {rank} fp32 masters", adam=True)
        if "params" in theirs:              # whole weights at stages 0-1: the fp32 masters themselves
            assert_state_close(ours["fp32"], theirs["params"], what=f"{script} rank {rank} weights", adam=True)


def test_zero3_init_builds_the_direct_build(results: list[dict]) -> None:
    direct = tiny_gpt(seq_len=SEQ).state_dict()
    for rank, res in enumerate(results):
        built = res["shardwise"]["zero3"]["built"]
        assert built.keys() <= direct.keys()
        for n, v in built.items():
            assert torch.equal(v, direct[n]), f"rank {rank}: zero.Init built {n} differently"


def test_zero3_init_module_partitions_a_built_model(results: list[dict]) -> None:
    direct = tiny_gpt(seq_len=SEQ).state_dict()
    for rank, res in enumerate(results):
        for side in ("shardwise", "deepspeed"):
            built = res[side]["zero3_module"]["built"]
            assert built.keys() == {n for n, _ in tiny_gpt(seq_len=SEQ).named_parameters()}
            for n, v in built.items():
                assert torch.equal(v, direct[n]), f"{side} rank {rank}: {n} is not rank 0's weight"
        assert_close_lists(res["shardwise"]["zero3_module"]["losses"], res["deepspeed"]["zero3_module"]["losses"],
                           rtol=1e-5, what=f"zero.Init(module=) rank {rank} losses")


def test_zero3_gathered_parameters_modify_and_read(results: list[dict]) -> None:
    direct = tiny_gpt(seq_len=SEQ).state_dict()
    for rank, res in enumerate(results):
        for side in ("shardwise", "deepspeed"):
            loaded = res[side]["zero3"]["loaded"]
            for n, v in loaded.items():
                want = direct[n] * (0.5 if n == SCALED else 1.0)
                assert torch.equal(v, want), f"{side} rank {rank}: {n} is not rank 0's value after modifier_rank=0"
        ours = res["shardwise"]["zero3"]
        assert_state_close(ours["trained"], ours["fp32"], what=f"rank {rank} gathered vs fp32", rtol=0, atol=0)


def test_zero3_full_grads_match_deepspeed(results: list[dict]) -> None:
    rtol = _norm_rtol() * ZERO3_STEPS
    for rank, res in enumerate(results):
        ours, theirs = res["shardwise"]["zero3"]["grads"], res["deepspeed"]["zero3"]["grads"]
        assert ours.keys() == theirs.keys()
        for n, want in theirs.items():
            if n.endswith("k_proj.bias"):    # exactly 0 in exact arithmetic: rounding noise on both sides
                continue
            scale = float(want.abs().max())
            assert scale > 0, n
            assert float((ours[n] - want).abs().max()) <= rtol * scale, f"rank {rank} safe_get_full_grad {n}"
    assert_state_close(results[1]["shardwise"]["zero3"]["grads"], results[0]["shardwise"]["zero3"]["grads"],
                       what="rank 1 vs rank 0 grads", rtol=0, atol=0)


def test_zero3_fp32_params_equal_the_single_process_reference(results: list[dict]) -> None:
    model = tiny_gpt(seq_len=SEQ)
    with torch.no_grad():
        dict(model.named_parameters())[SCALED].mul_(0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    steps = micro_steps(_batches(ZERO3_STEPS), grad_accum=1)
    train = lambda part: reference_train(model, opt, part, loss_fn=lambda m, mb: m(*mb),  # noqa: E731
                                         clip=ZERO3["gradient_clipping"])
    train(steps[:RESCALE_AT])
    with torch.no_grad():
        dict(model.named_parameters())[RESCALED].mul_(0.75)
    train(steps[RESCALE_AT:])
    want = {n: p.detach() for n, p in model.named_parameters()}
    for rank, res in enumerate(results):
        assert_state_close(res["shardwise"]["zero3"]["fp32"], want, what=f"rank {rank} vs reference", adam=True)
        theirs = {n: v for n, v in res["deepspeed"]["zero3"]["fp32"].items() if n != RESCALED}
        assert_state_close(theirs, {n: want[n] for n in theirs}, what=f"DeepSpeed rank {rank} vs reference",
                           adam=True)
