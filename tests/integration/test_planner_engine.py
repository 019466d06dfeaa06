"""The planner's predictions against the engine's own measurements (ZeRO stages 0-3, 2 gloo ranks).

Model states: `engine.memory_report()` equals the ZeRO formulas exactly (shards are ceil(psi / dp)), with
two explicit differences the formulas leave out or the report does not show:
- torch's Adam keeps a 4-byte scalar `step` tensor per tensor it steps (per parameter at stage 0, per flat
  master shard at stages 1-2);
- ZeRO-1/2 keep the parameters (and stage 1 its full gradients) in flat buffers padded to whole shards,
  dp * ceil(psi / dp) elements: at most dp - 1 more than psi.
Under ZeRO-Offload the report counts the (host) optimizer states under "optimizer", with the fp32 gradient shard
the host step reads (the masters' .grad, a kept host buffer); the planner puts them all in `cpu`.

Communication: the ledger records each collective's payload (an all-reduce's tensor, a reduce-scatter's
input, an all-gather's output); the planner's `payload_bytes` is that figure, padded to whole shards for
ZeRO. What a rank actually sends in a ring is 2 (p - 1) / p of an all-reduce's payload (the ZeRO paper's
"2 psi" for large p); that relationship is checked against the ring's own index arithmetic (`RingPlan`).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.comm.ring import RingPlan
from shardwise.models import gpt_config
from shardwise.planner import (
    JobSpec, Offload, Op, Optimizer, Plan, Precision, cluster_preset, dp_collectives, model_state_bytes,
    param_count, ring_send_bytes,
)
from shardwise.testing import run_distributed, shard_global_batch

SEQ, WORLD, BATCH = 16, 2, 8
# d_model 33 makes the parameter count odd (30,987), so ZeRO's shards are padded
CFG = gpt_config("tiny", n_layer=1, d_model=33, n_head=3, seq_len=SEQ)
BF16 = {"bf16": {"enabled": True}}

CASES = {  # name -> (precision, stage, offload, gradient accumulation, config additions)
    "stage0-fp32-gas2": (Precision.FP32, 0, Offload.NONE, 2, {}),
    "stage0-bf16-ring": (Precision.BF16, 0, Offload.NONE, 1, {**BF16, "communication": {"all_reduce": "ring"}}),
    "stage1-fp32-gas2": (Precision.FP32, 1, Offload.NONE, 2, {}),
    "stage2-fp32-gas2": (Precision.FP32, 2, Offload.NONE, 2, {}),
    "stage2-bf16": (Precision.BF16, 2, Offload.NONE, 1, BF16),
    "stage1-bf16-offload": (Precision.BF16, 1, Offload.OPTIMIZER, 1, BF16),
    "stage3-fp32-gas2": (Precision.FP32, 3, Offload.NONE, 2, {}),
}
FLAT_CASES = [c for c in CASES if CASES[c][1] < 3]   # one flat buffer per bucket: padding is one element here


def _train_and_report(stage: int, offload: Offload, gas: int, extra: dict) -> dict:
    import shardwise
    from shardwise.models import GPT
    torch.manual_seed(0)
    model = GPT(CFG)
    zero: dict = {"stage": stage}
    if stage == 3:       # every parameter sharded (none kept whole), as the ZeRO paper's P_os+g+p
        zero["stage3_param_persistence_threshold"] = 0
    if offload is Offload.OPTIMIZER:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_batch_size": BATCH, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra, "zero_optimization": zero}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(2):
        batch = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        micro = shard_global_batch(batch, dp_size=engine.dp_size, dp_rank=engine.dp_rank, grad_accum=gas)
        engine.train_batch(iter([(m[:, :-1], m[:, 1:]) for m in micro]))
    stepped = [p for g in engine.optimizer.param_groups for p in g["params"]]
    step_counters = sum(t.numel() * t.element_size() for state in engine.optimizer.state.values()
                        for key, t in state.items() if key == "step" and torch.is_tensor(t))
    out = {"memory": engine.memory_report(), "comm": engine.comm_report(), "step_counters": step_counters,
           "stepped_tensors": len(stepped), "num_params": sum(p.numel() for p in model.parameters())}
    if stage == 3:       # ZeRO-3 pads each unit's flat to whole shards; the root unit stays gathered into backward
        units = engine.dp_runtime.partition.units
        out["flats_padded"] = [f.layout.padded_numel for u in units for f in u.flats]
        out["root_padded"] = sum(u.padded_numel for u in units if u.is_root)
    return out


def _all_cases() -> dict:
    # one spawn of the ranks for every case: starting processes costs more than the training
    return {name: _train_and_report(stage, offload, gas, extra)
            for name, (_, stage, offload, gas, extra) in CASES.items()}


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_distributed(_all_cases, WORLD)


@pytest.mark.parametrize("case", FLAT_CASES)
def test_predicted_model_states_equal_the_engine(measured: list[dict], case: str) -> None:
    precision, stage, offload, _, _ = CASES[case]
    psi = param_count(CFG).total
    assert psi % WORLD == 1
    shard = math.ceil(psi / WORLD)
    p = model_state_bytes(psi, precision=precision, optimizer=Optimizer.ADAM, zero_stage=stage, dp=WORLD,
                          offload=offload)
    for r in (rank[case] for rank in measured):
        mem = r["memory"]
        assert r["num_params"] == psi
        padding = (shard * WORLD - psi) * precision.nbytes if stage >= 1 else 0   # one element here
        assert mem["params"] == p.weights + padding
        assert mem["grads"] == p.grads + (padding if stage == 1 else 0)
        assert r["step_counters"] == 4 * r["stepped_tensors"]
        states = mem["optimizer"] - r["step_counters"]
        if offload is Offload.NONE:
            assert states == p.optimizer
        else:
            assert p.optimizer == 0 and states == p.cpu


@pytest.mark.parametrize("case", FLAT_CASES)
def test_predicted_dp_traffic_equals_the_ledger(measured: list[dict], case: str) -> None:
    precision, stage, offload, gas, extra = CASES[case]
    job = JobSpec(global_batch=BATCH, seq_len=SEQ, precision=precision)
    plan = Plan(dp=WORLD, zero_stage=stage, offload=offload, micro_batch=BATCH // (WORLD * gas))
    predicted = {c.op: c for c in dp_collectives(CFG, cluster_preset("a100-80gb", num_gpus=WORLD), job, plan)}
    ring = extra.get("communication", {}).get("all_reduce") == "ring"
    ledger_name = {Op.ALL_REDUCE: "ring_all_reduce" if ring else "all_reduce",
                   Op.REDUCE_SCATTER: "reduce_scatter", Op.ALL_GATHER: "all_gather"}
    dtype = "float32" if precision is Precision.FP32 else "bfloat16"
    for r in (rank[case] for rank in measured):
        dp = {c["op"]: c for c in r["comm"] if c["group"] == "dp"}     # "dp:metrics" is bookkeeping
        assert set(dp) == {ledger_name[op] for op in predicted}
        for op, c in predicted.items():
            got = dp[ledger_name[op]]
            assert (got["count"], got["bytes"], got["dtype"]) == (c.calls, c.total_payload_bytes, dtype), op
    if stage == 0:   # one all-reduce per step whatever the accumulation, psi * bytes per gradient
        assert predicted[Op.ALL_REDUCE].total_payload_bytes == param_count(CFG).total * precision.nbytes
    if stage == 2:   # partitioned gradients are reduce-scattered on every micro-batch
        assert predicted[Op.REDUCE_SCATTER].calls == gas


def _ring_sent_elements(numel: int, size: int, rank: int) -> int:
    """Elements rank `rank` sends in our ring all-reduce: one chunk per step, 2 (size - 1) steps."""
    plan = RingPlan(numel, size, segment_numel=max(1, numel))
    return sum(plan.chunk_bounds(plan.send_chunk(rank, step))[1] for step in range(plan.num_steps))


@pytest.mark.parametrize("size", [2, 3, 4, 7, 8])
@pytest.mark.parametrize("numel", [1, 10, 1000, 12_345, 20_001])
def test_ring_wire_volume_is_the_planner_volume_up_to_chunk_rounding(numel: int, size: int) -> None:
    for rank in range(size):
        actual = _ring_sent_elements(numel, size, rank)
        assert abs(actual - ring_send_bytes(Op.ALL_REDUCE, numel, size)) < 2   # chunks differ by one element
        if size == 2:
            assert actual == numel                                             # 2 (p - 1) / p = 1: exact


def test_zero3_model_states_and_traffic_equal_the_planner_up_to_per_unit_padding(measured: list[dict]) -> None:
    """ZeRO-3 (fp32 Adam, no persistent parameters, 2 micro-batches): each rank holds psi/N of parameters,
    gradients and (8 bytes of) Adam states, padded per unit flat; per step every unit is all-gathered for each
    forward and each backward (2 m psi) and reduce-scattered once per backward (m psi). The one difference the
    planner's 3 psi leaves out, by design: the root unit (embeddings, head: whatever no block owns) stays
    gathered from its forward into its backward, as FSDP2 does, so it is gathered m times, not 2 m."""
    case = "stage3-fp32-gas2"
    precision, stage, offload, gas, _ = CASES[case]
    psi = param_count(CFG).total
    p = model_state_bytes(psi, precision=precision, optimizer=Optimizer.ADAM, zero_stage=stage, dp=WORLD)
    job = JobSpec(global_batch=BATCH, seq_len=SEQ, precision=precision)
    plan = Plan(dp=WORLD, zero_stage=stage, offload=offload, micro_batch=BATCH // (WORLD * gas))
    predicted = {c.op: c for c in dp_collectives(CFG, cluster_preset("a100-80gb", num_gpus=WORLD), job, plan)}
    for r in (rank[case] for rank in measured):
        flats, e = r["flats_padded"], precision.nbytes
        padded = sum(flats)
        assert 0 <= padded - psi <= len(flats) * (WORLD - 1)           # each flat: at most dp - 1 elements
        shard_bytes = padded // WORLD * e
        mem = r["memory"]
        assert p.weights <= mem["params"] == shard_bytes <= p.weights + len(flats) * e
        assert mem["grads"] == shard_bytes
        assert mem["optimizer"] - r["step_counters"] == 2 * shard_bytes       # Adam's m and v of the shards
        assert p.optimizer == 8 * math.ceil(psi / WORLD) and mem["optimizer"] - r["step_counters"] >= p.optimizer
        dp = {c["op"]: c for c in r["comm"] if c["group"] == "dp"}
        assert set(dp) == {"all_gather", "reduce_scatter"}
        assert dp["reduce_scatter"]["bytes"] == gas * padded * e
        assert dp["all_gather"]["bytes"] == 2 * gas * padded * e - gas * r["root_padded"] * e
        # the planner's figures: 2 m psi gathered, m psi reduce-scattered (padded to one flat of dp shards)
        rs, ag = predicted[Op.REDUCE_SCATTER], predicted[Op.ALL_GATHER]
        assert abs(rs.total_payload_bytes - dp["reduce_scatter"]["bytes"]) <= gas * len(flats) * WORLD * e
        assert abs(ag.total_payload_bytes - (dp["all_gather"]["bytes"] + gas * r["root_padded"] * e)) \
            <= 2 * gas * len(flats) * WORLD * e
