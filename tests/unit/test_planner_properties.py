"""Properties of the planner's formulas, checked with hypothesis."""

from __future__ import annotations

from typing import get_args

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardwise.models.presets import GPTConfig, MLPKind, Norm, Positions, gpt_flops_per_token, gpt_num_params
from shardwise.planner import (
    JobSpec, Offload, Op, Optimizer, PipelineSchedule, Plan, Precision, Recompute, bubble_fraction,
    cluster_preset, flops_per_token, iteration_flops, layer_activation_bytes, memory_per_rank, model_state_bytes,
    param_count, params_per_rank, ring_send_bytes,
)
from shardwise.planner.flops import params_per_stage

FAST = settings(max_examples=60, deadline=None)


@st.composite
def gpt_configs(draw: st.DrawFn) -> GPTConfig:
    n_head = draw(st.integers(1, 8))
    n_kv_head = draw(st.sampled_from([d for d in range(1, n_head + 1) if n_head % d == 0]))
    head_dim = 2 * draw(st.integers(1, 8))
    return GPTConfig(vocab_size=draw(st.integers(2, 600)), seq_len=draw(st.integers(1, 300)),
                     n_layer=draw(st.integers(1, 6)), n_head=n_head, n_kv_head=n_kv_head, d_model=n_head * head_dim,
                     d_ff=draw(st.none() | st.integers(1, 300)), positions=draw(st.sampled_from(["learned", "rotary"])),
                     bias=draw(st.booleans()), tie_embeddings=draw(st.booleans()))


@st.composite
def model_shapes(draw: st.DrawFn) -> GPTConfig:
    n_head = draw(st.sampled_from([1, 2, 4, 8, 16]))
    n_kv_head = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if n_head % d == 0]))
    return GPTConfig(n_layer=draw(st.integers(1, 48)), d_model=n_head * draw(st.sampled_from([8, 32, 64, 128])),
                     n_head=n_head, n_kv_head=n_kv_head, vocab_size=draw(st.integers(16, 70000)),
                     seq_len=draw(st.sampled_from([64, 512, 2048])), mlp=draw(st.sampled_from(get_args(MLPKind))),
                     norm=draw(st.sampled_from(get_args(Norm))), positions=draw(st.sampled_from(get_args(Positions))),
                     bias=draw(st.booleans()), tie_embeddings=draw(st.booleans()),
                     dropout=draw(st.sampled_from([0.0, 0.1])))


@FAST
@given(gpt_configs())
def test_count_of_our_gpt_is_exact_for_any_shape(cfg: GPTConfig) -> None:
    assert param_count(cfg).total == gpt_num_params(cfg)
    assert param_count(cfg).non_embedding == gpt_num_params(cfg, exclude_embeddings=True)
    assert flops_per_token(cfg, causal=True) == gpt_flops_per_token(cfg)


@FAST
@given(model_shapes(), st.integers(1, 16))
def test_pipeline_stages_partition_the_parameters(model: GPTConfig, pp: int) -> None:
    assume(pp <= model.n_layer)
    total = param_count(model).total
    assert params_per_rank(model) == total
    tied_copy = model.vocab_size * model.d_model if model.tie_embeddings and pp > 1 else 0
    assert sum(params_per_stage(model, tp=1, pp=pp)) == total + tied_copy
    for tp in (2, 4):
        assert params_per_rank(model, tp=tp, pp=pp) <= params_per_rank(model, tp=1, pp=pp)


stages = st.sampled_from([0, 1, 2, 3])
precisions = st.sampled_from(list(Precision))
psis = st.integers(10**6, 10**12)


@FAST
@given(psis, st.integers(1, 999), st.integers(1, 999), stages, precisions)
def test_model_states_fall_with_dp(psi: int, a: int, b: int, stage: int, precision: Precision) -> None:
    lo, hi = sorted((a, b))
    assume(lo < hi)
    small = model_state_bytes(psi, precision=precision, zero_stage=stage, dp=hi).total
    large = model_state_bytes(psi, precision=precision, zero_stage=stage, dp=lo).total
    if stage == 0:
        assert small == large
    else:
        assert small < large     # psi >= lo * hi, so the shards differ by at least one element


@FAST
@given(psis, st.integers(2, 4096), precisions, st.sampled_from([Optimizer.ADAM, Optimizer.SGD_MOMENTUM]))
def test_each_zero_stage_holds_less(psi: int, dp: int, precision: Precision, optimizer: Optimizer) -> None:
    totals = [model_state_bytes(psi, precision=precision, optimizer=optimizer, zero_stage=s, dp=dp).total
              for s in range(4)]
    assert totals[3] < totals[2] < totals[1] < totals[0]


@FAST
@given(psis, st.integers(1, 64), precisions)
def test_offload_moves_states_off_the_gpu(psi: int, dp: int, precision: Precision) -> None:
    on_gpu = model_state_bytes(psi, precision=precision, zero_stage=3, dp=dp)
    opt = model_state_bytes(psi, precision=precision, zero_stage=3, dp=dp, offload=Offload.OPTIMIZER)
    both = model_state_bytes(psi, precision=precision, zero_stage=3, dp=dp, offload=Offload.OPTIMIZER_AND_PARAMS)
    assert both.total < opt.total < on_gpu.total
    assert opt.optimizer == 0 and both.weights == 0 and both.cpu > opt.cpu > 0


@FAST
@given(st.integers(1, 64), st.integers(1, 1000), st.integers(1, 1000), st.sampled_from(list(PipelineSchedule)))
def test_bubble_falls_with_microbatches_and_grows_with_stages(p: int, m1: int, m2: int,
                                                              schedule: PipelineSchedule) -> None:
    assume(m1 < m2)
    v = 2 if schedule is PipelineSchedule.INTERLEAVED_1F1B else 1
    f = lambda stages, m: bubble_fraction(schedule, num_stages=stages, num_microbatches=m, virtual_stages=v)  # noqa
    plain = bubble_fraction(PipelineSchedule.ONE_F_ONE_B, num_stages=p, num_microbatches=m1)
    assert 0 <= f(p, m2) <= f(p, m1) < 1
    if p > 1:
        assert f(p, m2) < f(p, m1)
        assert f(p + 1, m1) > f(p, m1)
        # interleaving shortens the bubble, except with one micro-batch: nothing to interleave (as simulated)
        assert v == 1 or (f(p, m1) < plain if m1 > 1 else f(p, m1) == plain)


@FAST
@given(model_shapes(), st.integers(1, 8), st.sampled_from([1, 2, 4, 8]), st.booleans())
def test_activation_memory_orderings(model: GPTConfig, b: int, tp: int, flash: bool) -> None:
    kw = dict(micro_batch=b, seq_len=model.seq_len, flash_attention=flash)
    none, selective, full = (layer_activation_bytes(model, tp=tp, recompute=r, **kw) for r in Recompute)
    assert full < selective <= none
    assert layer_activation_bytes(model, tp=tp, sequence_parallel=True, **kw) <= none
    assert none <= layer_activation_bytes(model, tp=1, **kw)


@FAST
@given(model_shapes(), st.integers(1, 4), st.integers(1, 512))
def test_recomputation_adds_flops(model: GPTConfig, b: int, s: int) -> None:
    base = iteration_flops(model, batch=b, seq_len=s)
    assert iteration_flops(model, batch=b, seq_len=s, recompute=Recompute.SELECTIVE) >= base
    assert iteration_flops(model, batch=b, seq_len=s, recompute=Recompute.FULL) > base


@FAST
@given(st.floats(1, 1e12), st.integers(1, 4096))
def test_ring_all_reduce_is_reduce_scatter_plus_all_gather(n: float, p: int) -> None:
    ar = ring_send_bytes(Op.ALL_REDUCE, n, p)
    assert ar == ring_send_bytes(Op.REDUCE_SCATTER, n, p) + ring_send_bytes(Op.ALL_GATHER, n, p)
    assert ar < 2 * n
    assert ring_send_bytes(Op.ALL_REDUCE, n, 2 * p) >= ar


@FAST
@given(st.sampled_from(["gpt2-124m", "llama-7b", "1.3b"]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([0, 1, 2, 3]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]),
       st.sampled_from(list(PipelineSchedule)))
def test_memory_per_gpu_falls_with_more_data_parallel_ranks(name: str, dp: int, stage: int, tp: int, pp: int,
                                                            schedule: PipelineSchedule) -> None:
    from shardwise.planner import model_preset
    model, job = model_preset(name), JobSpec(global_batch=256)
    v = 2 if schedule is PipelineSchedule.INTERLEAVED_1F1B else 1
    plan = Plan(dp=dp, tp=tp, pp=pp, zero_stage=stage, schedule=schedule, virtual_stages=v,
                sequence_parallel=tp > 1)
    cluster = cluster_preset("h100-80gb", num_gpus=plan.world_size)
    wider = plan.replace(dp=2 * dp)
    more = memory_per_rank(model, cluster.replace(num_gpus=wider.world_size), job, wider).total
    assert more <= memory_per_rank(model, cluster, job, plan).total
