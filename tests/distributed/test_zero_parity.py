"""ZeRO stages 1 and 2 equal single-process training (fp32, 2 and 4 ranks, with accumulation and clipping);
model-state bytes follow the ZeRO paper's formulas; gradient-step traffic is 2 psi."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from test_dp_parity import CASES, SEQ, global_batches, run_reference
from shardwise.testing import assert_close_lists, assert_state_close, micro_steps, run_distributed, state_copy, tiny_gpt

ZERO_CASES = ["adamw", "sgd_accum_clip", "adam_ring_accum_clip"]


def _config(name: str, world: int, stage: int, **extra) -> dict:
    case = CASES[name]
    cfg = {"train_batch_size": 8, "gradient_accumulation_steps": case["gas"], "gradient_clipping": case["clip"],
           "optimizer": case["optimizer"], "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}}
    cfg.update(extra)
    return cfg


def _train_stages(stages: list[int], names: list[str]) -> dict:
    out = {stage: _train(stage, names) for stage in stages}
    out.update({(stage, "offload"): _train(stage, names[:2], offload=True) for stage in [*stages, 3]})
    out[(3, "param_offload")] = _train(3, names[:1], param_offload_only=True)
    return out


def _train(stage: int, names: list[str], offload: bool = False, param_offload_only: bool = False) -> dict:
    import shardwise
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name in names:
        model = tiny_gpt(seq_len=SEQ)
        extra = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                       "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       **({"offload_param": {"device": "cpu"}} if stage == 3 else {})}} if offload else {}
        if param_offload_only:     # the optimizer stays on the compute device: masters apart from the CPU shards
            extra = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 3000, "offload_param": {"device": "cpu"}}}
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(name, world, stage, **extra))
        if param_offload_only:
            flats = engine.dp_runtime.partition.flats
            assert all(m.device == f.compute_device and m.data_ptr() != f.shard.data_ptr()
                       for m, f in zip(engine.updater.masters, [f for f in flats if f.group is not None]))
        if offload and stage == 3:   # parameter shards wait on the CPU and are copied to the compute device
            assert all(f.compute_device is not None and f.shard.device.type == "cpu"
                       for f in engine.dp_runtime.partition.flats)
        if offload:
            assert all(m.device.type == "cpu" and m.data_ptr() != b.param_flat.data_ptr()
                       for m, b in zip(engine.updater.masters, engine.updater.buckets))
        steps = micro_steps(global_batches(), dp_size=world, dp_rank=rank, grad_accum=CASES[name]["gas"])
        losses = [engine.train_batch(iter(micro)) for micro in steps]
        state = engine.dp_runtime.gathered_state_dict(rank0_only=False) if stage == 3 else state_copy(model)
        out[name] = {"losses": losses, "state": state,
                     "memory": engine.memory_report(), "comm": engine.comm_report(),
                     "num_params": sum(p.numel() for p in model.parameters())}
        engine.close()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_matches_single_process(world_size):
    results = run_distributed(_train_stages, world_size, args=([1, 2], ZERO_CASES), timeout=400)
    for name in ZERO_CASES:
        ref_losses, ref_state = run_reference(CASES[name])
        keys = [1, 2] + ([(1, "offload"), (2, "offload"), (3, "offload")] if name in ZERO_CASES[:2] else [])
        for key in keys + ([(3, "param_offload")] if name == ZERO_CASES[0] else []):
            stage = key if isinstance(key, int) else f"{key[0]}+{key[1]}"
            for rank, res in enumerate(results):
                got = res[key][name]
                assert_close_lists(got["losses"], ref_losses, rtol=1e-5, what=f"stage {stage} {name} rank {rank}")
                assert_state_close(got["state"], ref_state, what=f"stage {stage} {name} rank {rank}",
                                   adam="Adam" in CASES[name]["optimizer"]["type"])


def _memory_and_comm_all() -> dict:
    return {(stage, bf16): _memory_and_comm(stage, bf16) for stage in (1, 2) for bf16 in (False, True)}


def _memory_and_comm(stage: int, bf16: bool) -> dict:
    import shardwise
    world = dist.get_world_size()
    model = tiny_gpt(seq_len=SEQ)
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config("adamw", world, stage, **extra))
    for micro in micro_steps(global_batches()[:2], dp_size=world, dp_rank=dist.get_rank(), grad_accum=1):
        engine.train_batch(iter(micro))
    buckets = engine.updater.buckets
    return {"memory": engine.memory_report(), "comm": engine.comm_report(),
            "psi": sum(p.numel() for p in model.parameters()),
            "padding": sum(b.layout.padded_numel - b.layout.numel for b in buckets),
            "tensors": len(buckets)}


def test_memory_formula_and_two_psi_traffic():
    n = 4
    results = run_distributed(_memory_and_comm_all, n)
    for (stage, bf16) in [(1, False), (1, True), (2, False), (2, True)]:
        for r in (res[(stage, bf16)] for res in results):
            psi, pad, mem = r["psi"], r["padding"], r["memory"]
            e = 2 if bf16 else 4                     # model dtype bytes
            padded = psi + pad
            assert mem["params"] == e * padded
            if stage == 1:
                assert mem["grads"] == e * padded                    # full gradients kept
            else:
                assert mem["grads"] == e * padded // n               # only this rank's shard
            k = 12 if bf16 else 8                    # Adam m, v (+ fp32 masters under bf16)
            assert k * padded // n <= mem["optimizer"] <= k * padded // n + 8 * r["tensors"]
            grad_traffic = [c for c in r["comm"] if c["group"] == "dp"]
            assert {c["op"] for c in grad_traffic} == {"reduce_scatter", "all_gather"}
            total = sum(c["bytes"] for c in grad_traffic)
            assert 2 * e * psi <= total <= 2 * e * padded            # 2 psi: reduce-scatter + all-gather


def _activation_bytes_by_stage() -> dict:
    import shardwise
    world, out = dist.get_world_size(), {}
    for stage in (0, 1, 2, 3):
        model = tiny_gpt(seq_len=SEQ)
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config("adamw", world, stage))
        (micro,) = micro_steps(global_batches()[:1], dp_size=world, dp_rank=dist.get_rank(), grad_accum=1)
        engine.train_batch(iter(micro))
        out[stage] = engine.memory_report()["activations"]
        engine.close()
    return out


def test_saved_activation_bytes_do_not_depend_on_the_stage():
    """Weights autograd saves (whole, sharded views, or ZeRO-3's gathered buffers) are not activations."""
    for res in run_distributed(_activation_bytes_by_stage, 2):
        assert res[0] > 0 and res[1] == res[0] and res[2] == res[0] and res[3] == res[0], res
