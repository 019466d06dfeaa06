"""Each rule of the step-time model on its own: GEMM-shape efficiency, memory-bound kernels, the head on the last
stage, pipeline scatter/gather, ZeRO-3 prefetch and per-module gathering, honest labels, MFU <= HFU, and the
calibration's GEMM fit."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.models import GPTConfig
from shardwise.planner import (
    JobSpec, Plan, Recompute, analyze, cluster_preset, model_preset, step_time,
)
from shardwise.planner.comm import Axis, Op, pp_collectives
from shardwise.planner.kernels import block_parts, gemm_seconds
from shardwise.planner.memory import memory_per_rank
from shardwise.planner.probes import _LINEAR_SHAPES, fit_gemm
from shardwise.planner.report import to_json
from shardwise.planner.rule import Strategy, describe, strategy_of
from shardwise.planner.specs import Zero3Gather
from shardwise.planner.time import hfu, mfu, microbatch_compute
from shardwise.planner.zero3 import buffer_elements, module_elements, prefetch_depth

A100 = cluster_preset("a100-80gb")
JOB = JobSpec(global_batch=64)


def _gpt(h: int, layers: int = 24, heads: int | None = None) -> GPTConfig:
    return GPTConfig(n_layer=layers, d_model=h, n_head=heads or h // 128, vocab_size=51200, seq_len=2048,
                     tie_embeddings=True, dropout=0.1)


def _rate(m: float, k: float, n: float, job: JobSpec = JOB) -> float:
    return 2 * m * k * n / gemm_seconds(m, k, n, A100, job)


def test_gemm_efficiency_rises_with_every_dimension_towards_the_ceiling() -> None:
    ceiling = A100.peak_flops_bf16 * A100.compute_efficiency
    for grow in range(3):           # M (tokens per micro-batch), K and N (hidden size, TP split)
        rates = []
        for size in (128, 512, 2048, 8192, 32768):
            dims = [4096.0, 4096.0, 4096.0]
            dims[grow] = size
            rates.append(_rate(*dims))
        assert rates == sorted(rates) and rates[0] < 0.6 * rates[-1]
        assert rates[-1] < ceiling
    # a TP split narrows N: each rank's GEMM runs further from the ceiling
    assert _rate(2048, 4096, 3 * 4096 / 8) < _rate(2048, 4096, 3 * 4096)
    # and with no operand term it is the ceiling whatever the shape
    flat = A100.replace(gemm_operand_bw=0.0)
    assert 2 * 64 * 64 * 64 / gemm_seconds(64, 64, 64, flat, JOB) == pytest.approx(ceiling)


def test_block_efficiency_grows_with_the_hidden_size() -> None:
    """Memory-bound kernels shrink against the matmuls as 1/h and a s / h^2: achieved FLOP/s per block grow."""
    plan = Plan(tp=8, micro_batch=1, recompute=Recompute.FULL)
    rates = []
    for h in (2048, 4096, 8192, 16384, 25600):
        model = _gpt(h, heads=h // 128)
        flops = 4 * 2 * 2048 * (12 * h * h + 2048 * h) / 8        # four passes of 24 s h^2 + 4 s^2 h, per rank
        rates.append(flops / block_parts(model, A100, JOB, plan).total_s)
    assert rates == sorted(rates) and rates[-1] > 1.15 * rates[0]
    flash = JobSpec(global_batch=64, flash_attention=True)   # no score traffic: less time
    assert block_parts(_gpt(4096), A100, flash, plan).total_s < block_parts(_gpt(4096), A100, JOB, plan).total_s


def test_last_stage_carries_the_output_layer() -> None:
    model, plan = _gpt(4096, layers=32), Plan(pp=4, micro_batch=1)
    stages = microbatch_compute(model, A100, JOB, plan).stages_s
    assert stages[1] == pytest.approx(stages[2]) and stages[-1] > stages[1] and stages[0] > stages[1]
    bigger_vocab = dataclasses.replace(model, vocab_size=4 * 51200)
    wider = microbatch_compute(bigger_vocab, A100, JOB, plan).stages_s
    assert wider[:3] == pytest.approx(stages[:3]) and wider[-1] > stages[-1]
    # the slowest stage sets the pace of every micro-batch; the others only fill and drain the pipeline
    t = step_time(model, A100.replace(num_gpus=4), JOB, plan)
    assert t.compute_s == pytest.approx(t.microbatches * max(stages))
    # layers the partitioner gives the first stages (33 = 9 + 8 + 8 + 8) make them the slowest
    uneven = microbatch_compute(_gpt(4096, layers=33), A100, JOB, plan).stages_s
    assert uneven[0] > uneven[1]


def test_pipeline_sends_with_and_without_scatter_gather() -> None:
    model, cluster = _gpt(8192, layers=48), A100.replace(num_gpus=64)
    full = 1 * 2048 * 8192 * 2                                                   # b s h bf16 bytes
    plain = Plan(dp=4, tp=8, pp=2)
    [send] = pp_collectives(model, cluster, JOB, plain)
    assert send.op is Op.SEND and send.payload_bytes == full and send.calls == 2 * plain.grad_accum(JOB)
    sg = JobSpec(global_batch=64, pp_scatter_gather=True)
    send, gather = pp_collectives(model, cluster, sg, plain)
    assert send.payload_bytes == full / 8 and send.link.value == "inter-node"
    assert (gather.axis, gather.op, gather.payload_bytes, gather.link.value) == (Axis.TP, Op.ALL_GATHER, full,
                                                                                   "intra-node")
    assert step_time(model, cluster, sg, plain).pp_comm_s < step_time(model, cluster, JOB, plain).pp_comm_s / 4
    # sequence parallelism already splits the activation: the same 1/t, nothing to gather
    [sp] = pp_collectives(model, cluster, sg, plain.replace(sequence_parallel=True))
    assert sp.payload_bytes == full / 8


def test_zero3_exposed_when_prefetch_cannot_hide_the_gathers() -> None:
    model, cluster = _gpt(4096, layers=32), A100.replace(num_gpus=64)   # gathers over InfiniBand
    plan = Plan(dp=64, zero_stage=3, micro_batch=1)
    ahead = JobSpec(global_batch=64, zero3_prefetch_elements=10 ** 9)          # four blocks
    prefetched = step_time(model, cluster, ahead, plan)
    none = step_time(model, cluster, JobSpec(global_batch=64, zero3_prefetch_elements=0), plan)
    assert step_time(model, cluster, JOB, plan).dp_exposed_s == none.dp_exposed_s   # 50M: no block fits
    assert none.dp_exposed_s == pytest.approx(none.dp_comm_s)            # depth 0: every gather waits
    assert prefetched.dp_exposed_s < none.dp_exposed_s
    # a block's gather (0.2 G elements, 8 ms at 25 GB/s) outlasts its forward at micro-batch 1: exposed
    assert prefetched.dp_exposed_s > 0.2 * prefetched.dp_comm_s
    bigger = step_time(model, cluster, JobSpec(global_batch=512, zero3_prefetch_elements=10 ** 9),
                       plan.replace(micro_batch=8, recompute=Recompute.FULL))
    assert bigger.dp_exposed_s / bigger.dp_comm_s < prefetched.dp_exposed_s / prefetched.dp_comm_s
    # our engine prefetches a block only if it fits in the bucket; DeepSpeed always takes the next module
    assert prefetch_depth(model, JOB, 1) == 0 and prefetch_depth(model, JobSpec(
        global_batch=64, zero3_prefetch_elements=10 ** 9), 1) == 4
    module = JobSpec(global_batch=64, zero3_gather=Zero3Gather.MODULE)
    assert prefetch_depth(model, module, 1) == 1


def test_per_module_gathering_holds_less() -> None:
    model = model_preset("gpt3-175b")
    mods = module_elements(model, 1)
    assert len(mods) == 6 and sum(mods) == pytest.approx(12 * 12288 ** 2 + 13 * 12288, rel=1e-9)
    block = JobSpec(global_batch=2560)
    module = JobSpec(global_batch=2560, zero3_gather=Zero3Gather.MODULE)
    plan = Plan(dp=640, zero_stage=3, micro_batch=4, recompute=Recompute.FULL)
    assert buffer_elements(model, block, plan) == 2 * sum(mods)
    assert buffer_elements(model, module, plan) == 2 * max(mods) < sum(mods)
    # Narayanan et al. 2021 Table 2 ran 530B under ZeRO-3 on 640 A100s at micro-batch 4 (DeepSpeed)
    big = GPTConfig(n_layer=105, d_model=20480, n_head=128, vocab_size=51200, seq_len=2048, tie_embeddings=True,
                    dropout=0.1)
    cluster = A100.replace(num_gpus=640)
    assert memory_per_rank(big, cluster, module, plan).fits
    assert not memory_per_rank(big, cluster, block, plan).fits


@pytest.mark.parametrize("dp,tp,pp,zero,strategy,text", [
    (8, 1, 1, 0, Strategy.DP, "DP 8"),
    (8, 1, 1, 3, Strategy.ZERO, "ZeRO-3 over DP 8"),
    (4, 8, 1, 3, Strategy.MODEL_PARALLEL, "TP 8 (+SP) x ZeRO-3 over DP 4"),
    (1, 8, 8, 1, Strategy.MODEL_PARALLEL, "TP 8 (+SP) x PP 8, ZeRO-1"),
    (4, 1, 8, 0, Strategy.MODEL_PARALLEL, "PP 8 x DP 4"),
    (16, 8, 8, 1, Strategy.THREE_D, "3D: TP 8 (+SP) x PP 8 x DP 16, ZeRO-1"),
])
def test_3d_only_with_all_three_axes(dp, tp, pp, zero, strategy, text) -> None:
    plan = Plan(dp=dp, tp=tp, pp=pp, zero_stage=zero, sequence_parallel=tp > 1)
    assert strategy_of(plan) is strategy and describe(plan) == text


@pytest.mark.parametrize("recompute", list(Recompute))
def test_mfu_never_exceeds_hfu(recompute: Recompute) -> None:
    model, cluster = model_preset("gpt3-175b"), A100.replace(num_gpus=64)
    t = step_time(model, cluster, JobSpec(global_batch=64), Plan(tp=8, pp=8, recompute=recompute))
    m, h = mfu(t, cluster, JOB, 64), hfu(t, cluster, JOB, 64)
    assert 0 < m <= h < 1
    assert (m == h) == (recompute is Recompute.NONE)
    if recompute is Recompute.FULL:            # 4 forwards of the blocks against 3
        assert h / m == pytest.approx(4 / 3, rel=0.01)


def test_gemm_fit_recovers_flops_and_traffic_terms() -> None:
    a, c = 2e-11, 5e-10
    times = [6 * m * k * n * a + 12 * (m * k + k * n + m * n) * c for m, k, n in _LINEAR_SHAPES]
    assert fit_gemm(times) == pytest.approx((a, c), rel=1e-6)
    flops_only = [6 * m * k * n * a for m, k, n in _LINEAR_SHAPES]
    per_flop, per_byte = fit_gemm(flops_only)
    assert per_flop == pytest.approx(a, rel=1e-6) and per_byte * 12 * 4096 * 4096 < 1e-6 * min(flops_only)


def test_json_has_mfu_hfu_strategy_and_the_reason() -> None:
    a = analyze(model_preset("gpt3-175b"), A100.replace(num_gpus=64), JobSpec(global_batch=64))
    out = to_json(a)
    plan = out["plan"]
    assert 0 < plan["mfu"] <= plan["hfu"] < 1 and plan["strategy"] == strategy_of(a.chosen.plan).value
    assert all(0 < e["mfu"] <= e["hfu"] for e in out["search"]["ranked"])
    assert out["reason"] == a.reason and a.reason.startswith(describe(a.chosen.plan))


# the seed document's ladder: 1.3B on 8 GPUs, 13B on 8, 30B on 8 x 40 GB, 175B on 1,024
@pytest.mark.parametrize("model,gpus,memory_gb,batch,accept", [
    (model_preset("1.3b"), 8, 80, 512, lambda p: p.tp == p.pp == 1 and p.offload.value == "none"),
    (_gpt(5120, layers=40, heads=40), 8, 80, 512, lambda p: p.pp == 1 and (p.zero_stage >= 2 or p.tp > 1)),
    (_gpt(7168, layers=48, heads=56), 8, 40, 512, lambda p: p.zero_stage >= 2 or p.tp * p.pp > 1),
    (model_preset("gpt3-175b"), 1024, 80, 1536, lambda p: p.tp == 8 and p.dp > 1),
])
def test_seed_ladder_recommendations(model, gpus, memory_gb, batch, accept) -> None:
    a = analyze(model, A100.replace(num_gpus=gpus, memory_bytes=memory_gb * 1e9), JobSpec(global_batch=batch))
    plan = a.chosen.plan
    assert a.chosen.feasible and accept(plan), plan.label()
    assert (strategy_of(plan) is Strategy.THREE_D) == (plan.tp > 1 and plan.pp > 1 and plan.dp > 1)
    assert a.reason and describe(plan) in a.reason


def test_a_ring_through_nodes_pays_the_network_latency_once_per_node() -> None:
    from shardwise.planner.comm import dp_collectives
    model, cluster = _gpt(2048, layers=4), A100.replace(num_gpus=64)
    [allreduce] = dp_collectives(model, cluster, JOB, Plan(dp=64))
    hops = 2 * 63                                 # 8 nodes: 7 InfiniBand hops and 56 NVLink hops per round
    alpha = (7 * cluster.inter_node_latency_s + 56 * cluster.intra_node_latency_s) / 63
    bandwidth = allreduce.payload_bytes * 2 * 63 / 64 / cluster.inter_node_bw
    assert allreduce.seconds == pytest.approx(allreduce.messages * hops * alpha + bandwidth, rel=1e-12)
