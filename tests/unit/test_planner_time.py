"""The step-time model's terms by hand: calibrated compute parts, the optimizer's tensors and cache, bucketed
overlap of gradient reduction, and the calibration's conversion of probe timings into a cluster."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest

from shardwise.models.presets import PRESETS, gpt_num_params
from shardwise.planner import (
    Axis, Collective, JobSpec, Link, Op, Plan, PlannerError, Precision, cluster_preset, forward_flops,
    model_preset, param_count, params_per_rank, step_time,
)
from shardwise.planner.calibrate import cluster_from_probes, fit_collective
from shardwise.planner.time import (
    MicrobatchCompute, _dp_exposed, microbatch_compute, optimizer_seconds, optimizer_tensor_sizes, param_tensor_sizes,
)
from shardwise.planner.zero3 import Zero3Shape, exposed_seconds

TINY = PRESETS["tiny"]
FP32 = JobSpec(global_batch=4, precision=Precision.FP32)
MEASURED = cluster_preset("a100-80gb", num_gpus=2).replace(
    peak_flops_fp32=1e11, compute_efficiency=1.0, attention_flops=5e10, activation_s=1e-8, norm_s=2e-9,
    layer_overhead_s=1e-4, microbatch_overhead_s=2e-4, gemm_operand_bw=0.0)   # matmuls: FLOPs over the rate


@pytest.mark.parametrize("name,tensors", [("tiny", 4 * 16 + 5), ("gpt2-124m", 12 * 16 + 4), ("llama-7b", 32 * 9 + 3)])
def test_parameter_tensors_add_up_to_the_exact_count(name: str, tensors: int) -> None:
    model = PRESETS[name] if name == "tiny" else model_preset(name)
    sizes = param_tensor_sizes(model)
    assert len(sizes) == tensors and sum(sizes) == param_count(model).total
    if name == "tiny":
        assert sum(sizes) == gpt_num_params(PRESETS["tiny"])
    if name == "llama-7b":     # every split dimension divides by 2: the slices add up to the rank's share
        for tp, pp in ((2, 1), (1, 4), (2, 3)):
            assert sum(param_tensor_sizes(model, tp=tp, pp=pp)) == params_per_rank(model, tp=tp, pp=pp)


def test_optimizer_steps_parameters_at_stage_0_and_flat_shards_under_zero() -> None:
    psi = param_count(TINY).total
    assert optimizer_tensor_sizes(TINY, Plan(dp=2)) == param_tensor_sizes(TINY)
    assert optimizer_tensor_sizes(TINY, Plan(dp=2, zero_stage=1)) == [math.ceil(psi / 2)]
    units = optimizer_tensor_sizes(TINY, Plan(dp=2, zero_stage=3))
    assert len(units) == TINY.n_layer + 1 and sum(units) == pytest.approx(psi / 2, abs=TINY.n_layer + 1)
    assert units[0] == math.ceil(sum(param_tensor_sizes(TINY)[:16]) / 2)        # one block's shard


def test_optimizer_time_by_hand_with_a_cache() -> None:
    cluster = MEASURED.replace(optimizer_tensor_s=1e-5, memory_bw=28e9, cache_bw=56e9, cache_bytes=16 * 1000)
    # fp32 Adam: 28 bytes streamed per parameter; weight + gradient + 2 moments = 16 bytes resident
    assert optimizer_seconds([1000, 2000], FP32, cluster, cluster.memory_bw) == pytest.approx(
        2e-5 + 1000 * 28 / 56e9 + 2000 * 28 / 28e9, rel=1e-12)
    no_cache = cluster.replace(cache_bytes=0.0)
    assert optimizer_seconds([1000, 2000], FP32, no_cache, no_cache.memory_bw) == pytest.approx(
        2e-5 + 3000 * 28 / 28e9, rel=1e-12)


def test_calibrated_compute_parts_by_hand() -> None:
    b, s, L, d, V = 2, TINY.seq_len, TINY.n_layer, TINY.d_model, TINY.vocab_size
    f = forward_flops(TINY, batch=b, seq_len=s)
    mb = microbatch_compute(TINY, MEASURED, FP32, Plan(micro_batch=b))
    assert mb.matmul_s == pytest.approx(3 * (f.dense + f.logits) / 1e11, rel=1e-12)
    assert mb.attention_s == pytest.approx(3 * 4 * b * s * s * d * L / 5e10, rel=1e-12)
    assert mb.pointwise_s == pytest.approx(b * s * (L * (4 * d * 1e-8 + 2 * d * 2e-9) + (d + V) * 2e-9), rel=1e-12)
    assert mb.operators_s == pytest.approx(L * 1e-4 + 2e-4, rel=1e-12)
    # the attention rate was measured with a causal kernel and is counted without the mask: same time
    causal = JobSpec(global_batch=4, precision=Precision.FP32, causal_flops=True)
    assert microbatch_compute(TINY, MEASURED, causal, Plan(micro_batch=b)).attention_s == mb.attention_s
    t = step_time(TINY, MEASURED, FP32, Plan(micro_batch=b))
    assert t.compute_s == pytest.approx(2 * mb.total_s, rel=1e-12)


def _collective(seconds: float, messages: int, op: Op = Op.ALL_REDUCE, calls: int = 1) -> Collective:
    return Collective(Axis.DP, op, "gradients", 2, 1e6, calls, Link.INTRA_NODE, seconds, messages)


@pytest.mark.parametrize("buckets,backward,share,exposed", [
    (1, 10.0, 1.0, 4.0),        # one bucket: ready when the backward ends, all of it exposed
    (4, 10.0, 1.0, 1.0),        # long backward: only the last bucket, c / k
    (4, 2.0, 1.0, 2.5),         # short backward: c - (k - 1) / k * backward
    (4, 10.0, 0.0, 4.0),        # collectives on the cores the compute needs: nothing hides
    (4, 10.0, 0.5, 2.5),
])
def test_bucketed_gradient_reduction_hides_behind_the_backward(buckets, backward, share, exposed) -> None:
    dp = [_collective(4.0, buckets)]
    mb = MicrobatchCompute(backward / 2, 0.0, 0.0, 0.0, backward_s=backward)
    assert _dp_exposed(dp, Plan(dp=2), 1, mb, True, share) == pytest.approx(exposed)
    assert _dp_exposed(dp, Plan(dp=2), 1, mb, False, share) == 4.0


def test_zero3_exposed_time_by_hand() -> None:
    # 2 micro-batches; per micro-batch one gather of everything 1.0 s (twice) and one reduce-scatter 1.0 s;
    # 4 blocks hold 80% of the parameters: per block g = r = 0.2 s, the rest 0.2 s each
    dp = [_collective(1.0, 4, Op.ALL_GATHER, calls=4), _collective(1.0, 4, Op.REDUCE_SCATTER, calls=2)]
    plan = Plan(dp=2, zero_stage=3)
    mb = MicrobatchCompute(0.0, 0.0, 0.0, 0.0, backward_s=0.0, block_forward_s=0.1, block_backward_s=0.3)
    shape = Zero3Shape(layers=4, block_share=0.8, depth=1)
    # forward: rest 0.2 + first block 0.2 + 3 x (0.2 - 0.1); backward with the reduce-scatters overlapped:
    # rest 0.2 + 0.2 + first block 0.2 + 3 x (0.4 - 0.3) + the last block's reduce-scatter 0.2
    assert _dp_exposed(dp, plan, 2, mb, True, 1.0, shape) == pytest.approx(2 * (0.7 + 1.1))
    # gradient reduction not overlapped: every reduce-scatter waits, gathers still prefetched (g < 0.3)
    assert _dp_exposed(dp, plan, 2, mb, False, 1.0, shape) == pytest.approx(2 * (0.7 + 0.2 + 0.2 + 1.0))
    # no prefetch (depth 0) or collectives that take the compute's cores (share 0): all of it
    assert _dp_exposed(dp, plan, 2, mb, True, 1.0, dataclasses.replace(shape, depth=0)) == pytest.approx(6.0)
    assert _dp_exposed(dp, plan, 2, mb, True, 0.0, shape) == pytest.approx(6.0)


def test_zero3_prefetch_hides_gathers_only_behind_the_block_before() -> None:
    # compute per block well above the gather: only the first block's and the rest's gathers stay exposed;
    # the same total compute in one block would hide nothing more, since a gather waits for the block before
    args = dict(gather_s=1.0, reduce_s=1.0, block_share=0.8, layers=4, depth=2, overlap_reduce=True, share=1.0)
    hidden = exposed_seconds(forward_s=10.0, backward_s=20.0, **args)
    assert hidden == pytest.approx(0.2 + 0.2 + 0.2 + 0.2 + 0.2 + 0.2)
    starved = exposed_seconds(forward_s=0.0, backward_s=0.0, **args)
    assert starved == pytest.approx(3.0)                  # no compute to hide behind: everything exposed
    assert hidden < exposed_seconds(forward_s=0.1, backward_s=0.2, **args) < starved


def _probes(ranks: int) -> dict[str, float]:
    p = {"linear_s_per_flop": 1e-11, "linear_bf16_s_per_flop": 1e-10, "attention_s_per_flop": 2e-11,
         "activation_s": 8e-9, "norm_s": 2e-9, "layer_overhead_s": 5e-4, "microbatch_overhead_s": 4e-4,
         "adam_s_per_param": 7e-9, "adam_cached_s_per_param": 2e-9, "adam_tensor_s": 3e-5,
         "cache_bytes": 32e6, "copy_s_per_byte": 1e-10, "ranks": float(ranks), "threads": 1.0,
         "small_bytes": 4096.0, "large_bytes": 8 << 20}
    if ranks > 1:   # timings that follow the ring model exactly
        for op, alpha, bw in ((Op.ALL_REDUCE, 1e-4, 1e9), (Op.REDUCE_SCATTER, 3e-4, 4e8),
                              (Op.ALL_GATHER, 2e-4, 6e8)):
            hops = 2 * (ranks - 1) if op is Op.ALL_REDUCE else ranks - 1
            steps = hops / ranks                                   # ring bytes sent per payload byte
            for tag in ("small", "large"):
                p[f"{op.value}_{tag}_s"] = hops * alpha + steps * p[f"{tag}_bytes"] / bw
    return p


def test_fit_collective_recovers_the_ring_model() -> None:
    probes = _probes(4)
    for op, alpha, bw in ((Op.ALL_REDUCE, 1e-4, 1e9), (Op.REDUCE_SCATTER, 3e-4, 4e8), (Op.ALL_GATHER, 2e-4, 6e8)):
        got_bw, got_alpha = fit_collective(op, probes, 4)
        assert got_bw == pytest.approx(bw, rel=1e-9) and got_alpha == pytest.approx(alpha, rel=1e-6)


def test_cluster_from_probes() -> None:
    c = cluster_from_probes(_probes(2))
    assert (c.num_gpus, c.gpus_per_node, c.compute_efficiency) == (2, 2, 1.0)
    assert c.peak_flops_fp32 == pytest.approx(1e11) and c.peak_flops_bf16 == pytest.approx(1e10)
    assert c.attention_flops == pytest.approx(5e10) and c.layer_overhead_s == 5e-4
    assert c.memory_bw == pytest.approx(28 / 7e-9) and c.cache_bw == pytest.approx(28 / 2e-9)
    assert c.cache_bytes == 16e6 and c.optimizer_tensor_s == 3e-5      # the two ranks share the cache
    assert (c.intra_node_bw, c.intra_node_latency_s) == pytest.approx((1e9, 1e-4))
    assert (c.reduce_scatter_bw, c.reduce_scatter_latency_s) == pytest.approx((4e8, 3e-4))
    assert c.comm_overlap == min(1.0, max(0.0, ((os.cpu_count() or 1) - 2) / 2))
    one = cluster_from_probes(_probes(1), link=(2e9, 1e-5))
    assert (one.num_gpus, one.intra_node_bw, one.reduce_scatter_bw) == (1, 2e9, 0.0)
    with pytest.raises(PlannerError, match="one rank measured no collectives"):
        cluster_from_probes(_probes(1))
