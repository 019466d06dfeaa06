"""Tensor parallelism composed with ZeRO stages 1, 2 and 3 (tp = 2 x dp = 2 on 4 ranks) equals single-process
training: the GPT with and without sequence parallelism, gradient accumulation, clipping that engages (the
whole-model norm is completed over the TP group: TP slices summed, replicated parameters counted once), and
ZeRO-Offload of the optimizer; losses and gathered parameters after 5 steps, rtol 1e-5. ZeRO shards each
rank's TP slice over its dp group, so the model states per rank follow the ZeRO formulas for psi / tp.
Checkpoints are written per TP rank (DeepSpeed's mp_rank_TT names) and a fresh engine resumes exactly."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.testing import (
    assert_close_lists, assert_state_close, lm_pair, mean_over_ranks, micro_steps, reference_train, run_distributed,
    shard_global_batch, state_copy, tiny_gpt, token_batches,
)

STEPS, GLOBAL_BATCH, SEQ, TP = 5, 8, 16, 2
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}
CASES = {
    "zero1_sp": dict(stage=1, sp=True, gas=1, clip=0.3, offload=False),
    "zero2_gas2_offload": dict(stage=2, sp=False, gas=2, clip=0.3, offload=True),
    "zero3_sp_gas2": dict(stage=3, sp=True, gas=2, clip=0.3, offload=False),
}


def batches() -> list[torch.Tensor]:
    """STEPS global batches [GLOBAL_BATCH, SEQ + 1] of tokens."""
    return token_batches(STEPS, GLOBAL_BATCH, SEQ + 1, seed=7)


def reference(case: dict) -> tuple[list[float], dict]:
    model = tiny_gpt(seq_len=SEQ)
    losses = reference_train(model, torch.optim.AdamW(model.parameters(), **ADAMW["params"]),
                             micro_steps(batches(), grad_accum=case["gas"]), loss_fn=lambda m, mb: m(*mb),
                             clip=case["clip"])
    return losses, state_copy(model)


def _engine(case: dict):
    import shardwise
    zero: dict = {"stage": case["stage"], "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 40}
    if case["offload"]:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": case["gas"],
              "gradient_clipping": case["clip"], "optimizer": ADAMW, "zero_optimization": zero,
              "tensor_parallel": {"size": TP, "sequence_parallel": case["sp"]}}
    model = tiny_gpt(seq_len=SEQ)
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _steps(engine, case: dict, global_batches: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, dp_rank = world // TP, rank // TP                      # tp innermost: ranks [d*tp, (d+1)*tp) share data
    losses, norms = [], []
    for b in global_batches:
        total = 0.0
        for x in shard_global_batch(b, dp_size=dp, dp_rank=dp_rank, grad_accum=case["gas"]):
            loss = engine(lm_pair(x))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        losses.append(mean_over_ranks(total / case["gas"]))   # TP peers hold equal losses: world mean = dp mean
        norms.append(engine.updater.last_grad_norm)
    return losses, norms


def _train(case: dict, ckpt_dir: str) -> dict:
    from shardwise.parallel.tensor_parallel import gather_full_state_dict
    engine = _engine(case)
    data = batches()
    losses, norms = _steps(engine, case, data[:3])
    engine.save_checkpoint(ckpt_dir)                           # per TP rank: mp_rank_TT files
    more, more_norms = _steps(engine, case, data[3:])
    tp_comm = engine.tp_comm
    local = None
    if case["stage"] == 3:      # the module holds placeholders between steps: gather this slice over dp first
        local = engine.dp_runtime.gathered_state_dict(rank0_only=False)
    named = dict(engine.module.named_parameters())
    slice_numel = sum(v.numel() for k, v in (local or engine.module.state_dict()).items() if k in named)
    out = {"losses": losses + more, "norms": norms + more_norms, "memory": engine.memory_report(),
           "state": gather_full_state_dict(engine.module, tp_comm, local), "slice_numel": slice_numel,
           "groups": sorted({c["group"] for c in engine.comm_report()}),
           "files": sorted(f.name for f in Path(ckpt_dir, "global_step3").iterdir())}
    engine.save_16bit_model(f"{ckpt_dir}/consolidated")     # ZeRO shards and TP slices assembled on rank 0
    if dist.get_rank() == 0:
        out["consolidated"] = torch.load(f"{ckpt_dir}/consolidated/pytorch_model.bin", weights_only=True)
    engine.close()
    resumed = _engine(case)                                    # a fresh model: everything comes from the files
    resumed.load_checkpoint(ckpt_dir)
    out["resumed_losses"], _ = _steps(resumed, case, data[3:])
    resumed.close()
    return out


def _all_cases(root: str) -> dict:
    torch.set_num_threads(1)
    return {name: _train(case, str(Path(root, name))) for name, case in CASES.items()}


def test_tensor_parallel_with_zero_equals_single_process(tmp_path: Path, one_thread):
    results = run_distributed(_all_cases, 4, args=(str(tmp_path),), timeout=420)
    for name, case in CASES.items():
        ref_losses, ref_state = reference(case)
        for rank, res in enumerate(results):
            got = res[name]
            assert_close_lists(got["losses"], ref_losses, rtol=1e-5, what=f"{name} rank {rank} losses")
            assert_state_close(got["state"], ref_state, what=f"{name} rank {rank}", adam=True)
            assert got["norms"][0] > case["clip"], f"{name}: clipping never engaged, the TP x ZeRO norm went untested"
            assert got["norms"] == results[0][name]["norms"], f"{name}: ranks disagree on the gradient norm"
            assert {"dp", "tp", "tp:metrics"} <= set(got["groups"]), got["groups"]
            # a checkpoint per TP rank (DeepSpeed's names: at ZeRO-3 model states per dp rank too), and a fresh
            # engine resumed from it takes exactly the same steps
            models = ([f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt" for d in range(2) for t in range(TP)]
                      if case["stage"] == 3 else [f"mp_rank_{t:02d}_model_states.pt" for t in range(TP)])
            assert got["files"] == sorted(models
                                          + [f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt"
                                             for d in range(2) for t in range(TP)]
                                          + ["shardwise_index.pt"]), got["files"]
            assert_close_lists(got["resumed_losses"], got["losses"][3:], rtol=1e-6, what=f"{name} resumed")
        consolidated = results[0][name]["consolidated"]
        assert consolidated.keys() == results[0][name]["state"].keys()
        for k, v in results[0][name]["state"].items():
            torch.testing.assert_close(consolidated[k], v, rtol=0, atol=0, msg=f"{name} save_16bit_model {k}")
            # Adam's two fp32 states (plus, when offloaded, the fp32 masters and their kept host gradient) of this
            # rank's shard of its TP slice: K * ceil(slice / dp) plus padding per bucket and a 4-byte step counter
            # per shard.
            k = 16 if case["offload"] else 8
            expected, got_bytes = k * got["slice_numel"] / 2, got["memory"]["optimizer"]
            assert expected <= got_bytes <= expected * 1.02 + 512, f"{name}: optimizer bytes {got_bytes} vs {expected}"
