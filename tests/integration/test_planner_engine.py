"""The planner's predictions against the engine's own measurements (ZeRO stage 0, 2 gloo ranks).

Model states: `engine.memory_report()` must equal the ZeRO formulas exactly, with one explicit extra the
formulas leave out: torch's Adam keeps a scalar `step` tensor per parameter tensor.

Communication: the ledger records each all-reduce's payload (the tensor: psi * bytes per gradient per
step); the planner's `payload_bytes` is that figure. What a rank actually sends in a ring is
2 (p - 1) / p of it (the ZeRO paper's "2 psi" for large p); that relationship is checked against the
ring's own index arithmetic (`RingPlan`), up to the rounding of uneven chunks.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.comm.ring import RingPlan
from shardwise.models import gpt_config
from shardwise.planner import (
    JobSpec, ModelSpec, Op, Optimizer, Plan, Precision, cluster_preset, dp_collectives, model_state_bytes,
    param_count, ring_send_bytes,
)
from shardwise.testing import run_distributed, shard_global_batch

SEQ, WORLD, BATCH = 16, 2, 8
CFG = gpt_config("tiny", n_layer=2, d_model=32, n_head=4, seq_len=SEQ)


def _train_and_report(extra: dict, gas: int, steps: int) -> dict:
    import shardwise
    from shardwise.models import GPT
    torch.manual_seed(0)
    model = GPT(CFG)
    config = {"train_batch_size": BATCH, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0}, **extra}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(steps):
        batch = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        micro = shard_global_batch(batch, dp_size=engine.dp_size, dp_rank=engine.dp_rank, grad_accum=gas)
        engine.train_batch(iter([(m[:, :-1], m[:, 1:]) for m in micro]))
    step_counters = sum(t.numel() * t.element_size() for state in engine.optimizer.state.values()
                        for key, t in state.items() if key == "step" and torch.is_tensor(t))
    return {"memory": engine.memory_report(), "comm": engine.comm_report(), "step_counters": step_counters,
            "buckets": [b.buffer.numel() for b in engine.grad_sync.buckets],
            "num_params": sum(p.numel() for p in model.parameters())}


CASES = {  # name -> (precision, config additions, gradient accumulation, ledger op names)
    "fp32-backend-gas2": (Precision.FP32, {}, 2, {"all_reduce"}),
    "bf16-ring": (Precision.BF16, {"bf16": {"enabled": True}, "communication": {"all_reduce": "ring"}}, 1,
                  {"ring_all_reduce"}),
}


def _all_cases() -> dict:
    # one spawn of the ranks for every case: starting processes costs more than the training
    return {name: _train_and_report(extra, gas, 2) for name, (_, extra, gas, _) in CASES.items()}


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_distributed(_all_cases, WORLD)


@pytest.mark.parametrize("case", list(CASES))
def test_predicted_model_states_and_dp_traffic_equal_the_engine(measured: list[dict], case: str) -> None:
    precision, _, _, ops = CASES[case]
    spec = ModelSpec.from_gpt_config(CFG)
    psi = param_count(spec).total
    reports = [rank[case] for rank in measured]
    predicted = model_state_bytes(psi, precision=precision, optimizer=Optimizer.ADAM, zero_stage=0, dp=WORLD)
    job = JobSpec(global_batch=BATCH, seq_len=SEQ, precision=precision)
    (grad_sync,) = dp_collectives(spec, cluster_preset("a100-80gb", num_gpus=WORLD), job, Plan(dp=WORLD))
    for r in reports:
        assert r["num_params"] == psi
        mem = r["memory"]
        assert mem["params"] == predicted.weights
        assert mem["grads"] == predicted.grads
        # K psi (Adam m, v; + fp32 masters under bf16) plus torch's per-tensor scalar step counters
        assert r["step_counters"] == 4 * len(list(_param_tensors()))
        assert mem["optimizer"] - r["step_counters"] == predicted.optimizer
        dp = [c for c in r["comm"] if c["group"] == "dp"]
        assert {c["op"] for c in dp} == ops
        assert {c["dtype"] for c in dp} == {"float32" if precision is Precision.FP32 else "bfloat16"}
        # one reduction per optimizer step (on the accumulation boundary), in one bucket at the default size
        assert sum(c["count"] for c in dp) == grad_sync.calls == len(r["buckets"]) == 1
        assert grad_sync.op is Op.ALL_REDUCE and grad_sync.group_size == WORLD
        assert sum(c["bytes"] for c in dp) == grad_sync.total_payload_bytes == psi * precision.nbytes
        # the wire: a rank of the ring sends 2 (p - 1) / p of the payload; at p = 2, exactly the payload
        element = precision.nbytes
        sent = sum(_ring_sent_elements(n, WORLD, rank) for n in r["buckets"] for rank in range(WORLD)) / WORLD
        assert sent * element == grad_sync.sent_bytes == psi * element


def _param_tensors():
    from shardwise.models import GPT
    with torch.device("meta"):
        return GPT(CFG).parameters()


def _ring_sent_elements(numel: int, size: int, rank: int) -> int:
    """Elements rank `rank` sends in our ring all-reduce: one chunk per step, 2 (size - 1) steps."""
    plan = RingPlan(numel, size, segment_numel=max(1, numel))
    return sum(plan.chunk_bounds(plan.send_chunk(rank, step))[1] for step in range(plan.num_steps))


@pytest.mark.parametrize("size", [2, 3, 4, 7, 8])
@pytest.mark.parametrize("numel", [1, 10, 1000, 12_345])
def test_ring_wire_volume_is_the_planner_volume_up_to_chunk_rounding(numel: int, size: int) -> None:
    for rank in range(size):
        actual = _ring_sent_elements(numel, size, rank)
        assert abs(actual - ring_send_bytes(Op.ALL_REDUCE, numel, size)) < 2   # chunks differ by one element
