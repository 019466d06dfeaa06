"""Pipeline x tensor x data parallelism with every ZeRO stage: GPT training equals single-process training.

- 4 gloo ranks as pp = 2 x tp = 2 (each stage's layers sliced over its TP pair; p2p between the stages of one
  TP coordinate) with 1F1B, GPipe and interleaved 1F1B, sequence parallelism, ZeRO 0/1/2;
- 4 ranks as pp = 2 x dp = 2 with ZeRO-3 (which DeepSpeed refuses with pipelines): each stage's layers are
  units sharded over the stage's dp group, gathered around every micro-batch's forward and backward while
  several micro-batches are in flight; each model chunk is a root of its own (interleaved runs chunks one at a
  time); the parameters held between steps are ~1/dp of the stage's;
- 8 ranks as pp = 2 x dp = 2 x tp = 2 with ZeRO-1 and ZeRO-3, and the 4-D pp = 2 x dp = 1 x cp = 2 x tp = 2 (ring
  attention with sequence parallelism, ZeRO-1 over the dp x cp ranks).
Every case accumulates gradients (= micro-batches) and clips with a norm that engages (TP slices summed over
tp, every stage's layers over pp, shards over dp). Losses and gathered parameters after 4 steps, rtol 1e-5; then
`engine.eval_batch` on 3 micro-batches of another sequence length equals the trained reference's eval loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.testing import (
    assert_close_lists, assert_state_close, lm_pair, micro_steps, reference_train, run_distributed, state_copy,
    tiny_gpt, token_batches,
)

SEQ, MICRO, STEPS, PP, CLIP = 16, 2, 4, 2, 0.3
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
# Adam divides by sqrt(v): on weights whose true gradient is ~0 it turns reduction-order rounding into visible
# steps (docs/design.md, "tolerances"), so most cases use SGD with momentum, whose update is linear.
CASES = {
    "tp2_1f1b_sp_zero0": dict(tp=2, schedule="1f1b", v=1, sp=True, zero=0, gas=4, optimizer=ADAMW),
    "tp2_gpipe_zero1": dict(tp=2, schedule="gpipe", v=1, sp=False, zero=1, gas=2, optimizer=SGD),
    "tp2_interleaved_sp_zero2": dict(tp=2, schedule="interleaved_1f1b", v=2, sp=True, zero=2, gas=4, optimizer=SGD),
    "dp2_1f1b_zero3": dict(tp=1, schedule="1f1b", v=1, sp=False, zero=3, gas=4, optimizer=SGD),
    "dp2_gpipe_zero3": dict(tp=1, schedule="gpipe", v=1, sp=False, zero=3, gas=2, optimizer=SGD),
    "dp2_interleaved_zero3": dict(tp=1, schedule="interleaved_1f1b", v=2, sp=False, zero=3, gas=4, optimizer=SGD),
}
CASES_8 = {   # pp 2 x dp 2 x tp 2: ZeRO shards over dp, its norm over pp x dp of one TP coordinate, then tp
    "dp2_tp2_1f1b_sp_zero1": dict(tp=2, schedule="1f1b", v=1, sp=True, zero=1, gas=2, optimizer=SGD),
    "dp2_tp2_gpipe_zero3": dict(tp=2, schedule="gpipe", v=1, sp=False, zero=3, gas=2, optimizer=SGD),
    "cp2_tp2_1f1b_sp_zero1": dict(tp=2, cp=2, schedule="1f1b", v=1, sp=True, zero=1, gas=2, optimizer=SGD),
}


def global_batches(rows: int) -> list[torch.Tensor]:
    """STEPS global batches [rows, SEQ + 1] of tokens."""
    return token_batches(STEPS, rows, SEQ + 1, seed=11)


EVAL_SEQ, EVAL_MICRO_BATCHES = 8, 3


def eval_batch(dp: int) -> torch.Tensor:
    """[MICRO * 3 * dp, EVAL_SEQ + 1] tokens: each dp rank's 3 eval micro-batches, shorter than training's."""
    return token_batches(1, MICRO * EVAL_MICRO_BATCHES * dp, EVAL_SEQ + 1, seed=13)[0]


def reference(case: dict, dp: int) -> tuple[list[float], dict, float]:
    model = tiny_gpt(n_layer=4, seq_len=SEQ)
    # the dp ranks' micro-batches k = 0 .. gas - 1 of a step, in order: gas * dp micro-batches of MICRO rows
    steps = micro_steps(global_batches(MICRO * case["gas"] * dp), grad_accum=case["gas"] * dp)
    cls = torch.optim.AdamW if case["optimizer"] is ADAMW else torch.optim.SGD
    losses = reference_train(model, cls(model.parameters(), **case["optimizer"]["params"]), steps,
                             loss_fn=lambda m, mb: m(*mb), clip=CLIP)
    model.eval()
    with torch.no_grad():   # equal micro-batches: their mean loss is the whole batch's
        eval_loss = float(model(*lm_pair(eval_batch(dp))))
    return losses, state_copy(model), eval_loss


def _run(case: dict) -> dict:
    import shardwise
    from shardwise.parallel.tensor_parallel import gather_full_state_dict
    world = dist.get_world_size()
    cp = case.get("cp", 1)
    dp = world // (PP * case["tp"] * cp)
    config = {"train_batch_size": MICRO * case["gas"] * dp, "gradient_accumulation_steps": case["gas"],
              "gradient_clipping": CLIP, "optimizer": case["optimizer"],
              "zero_optimization": {"stage": case["zero"], "reduce_bucket_size": 3000,
                                    "stage3_param_persistence_threshold": 40},
              "pipeline": {"stages": PP, "schedule": case["schedule"], "virtual_stages": case["v"]}}
    if case["tp"] > 1:
        config["tensor_parallel"] = {"size": case["tp"], "sequence_parallel": case["sp"]}
    if cp > 1:
        config["context_parallel"] = {"size": cp}
    model = tiny_gpt(n_layer=4, seq_len=SEQ)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = [engine.train_batch(iter(micro))
              for micro in micro_steps(global_batches(MICRO * case["gas"] * dp), dp_size=dp, dp_rank=engine.dp_rank,
                                       grad_accum=case["gas"])]
    (micro,) = micro_steps([eval_batch(dp)], dp_size=dp, dp_rank=engine.dp_rank, grad_accum=EVAL_MICRO_BATCHES)
    eval_loss = engine.eval_batch(iter(micro), num_micro_batches=EVAL_MICRO_BATCHES)
    stage = engine.pipeline.stage
    local = engine.dp_runtime.gathered_state_dict(stage, rank0_only=False)     # ZeRO-3 shards gathered over dp
    local = gather_full_state_dict(stage, engine.tp_comm, local)               # TP slices (copies without TP)
    names = stage.full_names()
    parts: list = [None] * world
    dist.all_gather_object(parts, {names[k]: v for k, v in local.items()})
    stage_numel = sum(v.numel() for v in local.values())
    out = {"losses": losses, "eval": eval_loss, "state": {k: v for p in parts for k, v in p.items()}, "dp": dp,
           "norm": engine.updater.last_grad_norm, "param_bytes": engine.memory_report()["params"],
           "stage_numel": stage_numel, "groups": sorted({c["group"] for c in engine.comm_report()})}
    engine.close()
    return out


def _all(cases: dict) -> dict:
    torch.set_num_threads(1)
    return {name: _run(case) for name, case in cases.items()}


def test_pipeline_with_tensor_parallel_or_zero3_equals_single_process(one_thread) -> None:
    _check(CASES, run_distributed(_all, 4, args=(CASES,), timeout=420))


def test_three_d_with_data_parallel_on_8_ranks(one_thread) -> None:
    _check(CASES_8, run_distributed(_all, 8, args=(CASES_8,), timeout=420))


def _check(cases: dict, results: list[dict]) -> None:
    for name, case in cases.items():
        ref_losses, ref_state, ref_eval = reference(case, results[0][name]["dp"])
        norms = {r[name]["norm"] for r in results}
        assert len(norms) == 1 and norms.pop() > CLIP, f"{name}: every rank clips by the one global norm"
        for rank, res in enumerate(results):
            got = res[name]
            assert_close_lists(got["losses"], ref_losses, rtol=1e-5, what=f"{name} rank {rank} losses")
            assert_close_lists([got["eval"]], [ref_eval], rtol=1e-5, what=f"{name} rank {rank} eval loss")
            groups = set(got["groups"])
            # gradients are reduced over the dp x cp ranks (the "dp" group the parameters see)
            cp = case.get("cp", 1)
            assert "pp" in groups and ("tp" in groups) == (case["tp"] > 1) and ("cp" in groups) == (cp > 1)
            assert ("dp" in groups) == (got["dp"] * cp > 1), (name, groups)
            assert_state_close(got["state"], ref_state, what=f"{name} rank {rank}", adam=case["optimizer"] is ADAMW)
            if case["zero"] == 3:   # held between steps: ~1/dp of the stage's parameters (+ small persistent ones)
                assert got["param_bytes"] < 0.6 * 4 * got["stage_numel"], (name, got["param_bytes"])
