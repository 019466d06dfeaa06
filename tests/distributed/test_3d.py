"""3D parallelism: pipeline x tensor (x data) parallel training of the GPT equals single-process training.

8 gloo ranks as pp = 2 x dp = 2 x tp = 2 with ZeRO-1 and ZeRO-3, and 4 as pp = 2 x tp = 2 (each stage's layers sliced over its TP pair; p2p between the stages of one TP
coordinate), with 1F1B, GPipe and interleaved 1F1B, sequence parallelism, ZeRO-1/2, gradient accumulation
(= micro-batches) and clipping that engages (the norm: TP slices summed over tp and every stage's layers
over pp). Losses and gathered parameters after 4 steps, rtol 1e-5.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.testing import assert_close_lists, reference_train, run_distributed, shard_global_batch

SEQ, MICRO, STEPS, PP, TP = 16, 2, 4, 2, 2
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
# Adam divides by sqrt(v): on weights whose true gradient is ~0 it turns reduction-order rounding into visible
# steps (docs/design.md, "tolerances"), so the ZeRO cases use SGD with momentum, whose update is linear.
CASES = {
    "1f1b_sp_zero0": dict(schedule="1f1b", v=1, sp=True, zero=0, gas=4, optimizer=ADAMW),
    "gpipe_zero1": dict(schedule="gpipe", v=1, sp=False, zero=1, gas=2, optimizer=SGD),
    "interleaved_sp_zero2": dict(schedule="interleaved_1f1b", v=2, sp=True, zero=2, gas=4, optimizer=SGD),
}
CASES_8 = {   # pp 2 x dp 2 x tp 2: ZeRO shards over dp, its norm over pp x dp of one TP coordinate, then tp
    "dp2_1f1b_sp_zero1": dict(schedule="1f1b", v=1, sp=True, zero=1, gas=2, optimizer=SGD),
    "dp2_gpipe_zero3": dict(schedule="gpipe", v=1, sp=False, zero=3, gas=2, optimizer=SGD),
}
CLIP = 0.3


def tiny_gpt() -> torch.nn.Module:
    from shardwise.models import GPT, gpt_config
    torch.manual_seed(1234)
    return GPT(gpt_config("tiny", n_layer=4, d_model=32, n_head=4, seq_len=SEQ))


def global_batches(rows: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (rows, SEQ + 1), generator=g) for _ in range(STEPS)]


def reference(case: dict, dp: int) -> tuple[list[float], dict]:
    model = tiny_gpt()
    rows = MICRO * case["gas"] * dp
    steps = [[(m[:, :-1], m[:, 1:]) for m in shard_global_batch(b, dp_size=1, dp_rank=0, grad_accum=case["gas"] * dp)]
             for b in global_batches(rows)]
    cls = torch.optim.AdamW if case["optimizer"] is ADAMW else torch.optim.SGD
    losses = reference_train(model, cls(model.parameters(), **case["optimizer"]["params"]), steps,
                             loss_fn=lambda m, mb: m(*mb), clip=CLIP)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(case: dict) -> dict:
    import shardwise
    from shardwise.parallel.tensor_parallel import gather_full_state_dict
    world = dist.get_world_size()
    dp = world // (PP * TP)
    config = {"train_batch_size": MICRO * case["gas"] * dp, "gradient_accumulation_steps": case["gas"],
              "gradient_clipping": CLIP, "optimizer": case["optimizer"],
              "zero_optimization": {"stage": case["zero"], "reduce_bucket_size": 3000},
              "tensor_parallel": {"size": TP, "sequence_parallel": case["sp"]},
              "pipeline": {"stages": PP, "schedule": case["schedule"], "virtual_stages": case["v"]}}
    model = tiny_gpt()
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for b in global_batches(MICRO * case["gas"] * dp):
        micro = [(m[:, :-1], m[:, 1:]) for m in shard_global_batch(b, dp_size=dp, dp_rank=engine.dp_rank,
                                                                    grad_accum=case["gas"])]
        losses.append(engine.train_batch(iter(micro)))
    stage = engine.pipeline.stage
    names = stage.full_names()
    local = engine.grad_sync.gathered_state_dict(rank0_only=False) if case["zero"] == 3 else None
    full = {names[k]: v for k, v in gather_full_state_dict(stage, engine.tp_comm, local).items()}
    parts: list = [None] * world
    dist.all_gather_object(parts, full)
    out = {"losses": losses, "state": {k: v for p in parts for k, v in p.items()},
           "norm": engine.optimizer_step.last_grad_norm, "dp": dp,
           "groups": sorted({c["group"] for c in engine.comm_report()})}
    engine.close()
    return out


def _all(cases: dict) -> dict:
    torch.set_num_threads(1)
    return {name: _run(case) for name, case in cases.items()}


def test_pipeline_by_tensor_parallel_equals_single_process() -> None:
    _check(CASES, run_distributed(_all, PP * TP, args=(CASES,), timeout=420))


def test_three_d_with_data_parallel_on_8_ranks() -> None:
    _check(CASES_8, run_distributed(_all, 2 * PP * TP, args=(CASES_8,), timeout=420))


def _check(cases: dict, results: list[dict]) -> None:
    torch.set_num_threads(1)
    for name, case in cases.items():
        ref_losses, ref_state = reference(case, results[0][name]["dp"])
        norms = {r[name]["norm"] for r in results}
        assert len(norms) == 1 and norms.pop() > CLIP, f"{name}: every rank clips by the one global norm"
        for rank, res in enumerate(results):
            got = res[name]
            assert_close_lists(got["losses"], ref_losses, rtol=1e-5, what=f"{name} rank {rank} losses")
            assert {"pp", "tp"} <= set(got["groups"]) and ("dp" in got["groups"]) == (got["dp"] > 1), got["groups"]
            assert got["state"].keys() == ref_state.keys()
            for k, v in ref_state.items():
                if k.endswith("k_proj.bias"):
                    continue   # exactly-zero true gradient: Adam turns rounding noise into +-lr steps (see DP test)
                torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, k=k: f"{name} rank {rank} {k}: {m}")
