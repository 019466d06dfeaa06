"""The planner's context parallelism: activation memory per rank at S / cp, the ring's and Ulysses' bytes and
their overlap with attention, the layout rules, the search's use of cp when a sequence fits no other way, and
`shardwise plan --seq` / `--cp` / `--write-config`."""

from __future__ import annotations

import json
import math

import pytest

from shardwise.cli.main import main
from shardwise.config import load_config_for_world
from shardwise.models.presets import gpt_config
from shardwise.planner import (
    JobSpec, Op, Plan, Precision, Recompute, activation_bytes, cluster_preset, deepspeed_config, evaluate,
    layer_activation_bytes, memory_per_rank, model_preset, search, step_collectives, step_time,
)
from shardwise.planner.comm import Axis
from shardwise.planner.search import Reason, layout_problems

LLAMA = gpt_config("llama-small")      # 6 layers, d 384, 6 heads sharing 2 kv heads, d_ff 1024, rotary
CLUSTER = cluster_preset("h100-80gb", num_gpus=8)


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
@pytest.mark.parametrize("recompute", list(Recompute))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_activation_is_per_token_under_fused_attention(impl, recompute, precision) -> None:
    """With no stored scores every term of a layer scales with this rank's tokens S / cp: the layer at (S, cp)
    equals the layer at (2S, 2cp), and cp 4 holds half of cp 2."""
    e = Precision(precision).nbytes
    layer = lambda s, c: layer_activation_bytes(LLAMA, micro_batch=2, seq_len=s, cp=c, cp_impl=impl,  # noqa: E731
                                                act_bytes=e, recompute=recompute, flash_attention=True)
    assert layer(256, 2) == pytest.approx(layer(512, 4), rel=1e-12)
    assert layer(256, 4) == pytest.approx(layer(256, 2) / 2, rel=1e-12)


def test_scores_ring_stores_none_ulysses_a_cp_th() -> None:
    """Unfused attention: the ring never stores a score (one block at a time); Ulysses stores a / cp heads of
    S x S scores, so at a fixed S / cp its scores grow with S while the ring's layer does not."""
    layer = lambda s, c, impl: layer_activation_bytes(LLAMA, micro_batch=1, seq_len=s, cp=c,  # noqa: E731
                                                      cp_impl=impl, act_bytes=2)
    assert layer(1024, 2, "ring") == pytest.approx(layer(2048, 4, "ring"), rel=1e-12)
    scores = LLAMA.n_head * 2                           # a x e bytes per score, no dropout
    grew = layer(2048, 4, "ulysses") - layer(1024, 2, "ulysses")
    assert grew == pytest.approx(scores * (2048 ** 2 / 4 - 1024 ** 2 / 2), rel=1e-12)


def test_model_states_do_not_shrink_with_cp_but_shard_over_dp_times_cp() -> None:
    job = JobSpec(global_batch=8, seq_len=4096)
    one = memory_per_rank(LLAMA, CLUSTER, job, Plan(dp=8))
    four = memory_per_rank(LLAMA, CLUSTER, job, Plan(dp=2, cp=4))
    assert four.model_states == one.model_states                 # stage 0: replicated over dp x cp either way
    zero3 = memory_per_rank(LLAMA, CLUSTER, job, Plan(dp=2, cp=4, zero_stage=3))
    assert zero3.weights == memory_per_rank(LLAMA, CLUSTER, job, Plan(dp=8, zero_stage=3)).weights
    fused = JobSpec(global_batch=8, seq_len=4096, flash_attention=True)       # no stored scores at cp 1 either
    per_rank = activation_bytes(LLAMA, fused, Plan(dp=2, cp=4)).total
    assert per_rank == pytest.approx(activation_bytes(LLAMA, fused, Plan(dp=8)).total / 4, rel=0.10)
    # stored scores at cp 1 (S^2): the ring, which stores none, holds far less than a quarter
    assert activation_bytes(LLAMA, job, Plan(dp=2, cp=4)).total < activation_bytes(LLAMA, job, Plan(dp=8)).total / 4


def test_ring_bytes_per_step() -> None:
    """Per layer and micro-batch a rank sends cp - 1 key/value blocks [2, b, kv, S/cp] forward, cp - 1 more in
    backward, and cp fp32 dk/dv blocks; a recomputed forward runs the ring once more."""
    job = JobSpec(global_batch=4, seq_len=1024, precision="bf16")
    for recompute, forwards in ((Recompute.NONE, 1), (Recompute.SELECTIVE, 2), (Recompute.FULL, 2)):
        plan = Plan(dp=2, cp=4, micro_batch=1, recompute=recompute)
        cp = [c for c in step_collectives(LLAMA, CLUSTER, job, plan) if c.axis is Axis.CP]
        block = 2 * 1 * (1024 // 4) * LLAMA.kv_dim
        m = plan.grad_accum(job)
        expected = LLAMA.n_layer * m * ((forwards + 1) * 3 * block * 2 + 4 * block * 4)
        assert sum(c.sent_bytes for c in cp) == expected
        assert all(c.op is Op.SEND and c.group_size == 4 for c in cp)


def test_ulysses_bytes_per_step() -> None:
    """Four all-to-alls a pass (q, k, v, output), each rank sending (cp - 1) / cp of them; kv heads fewer than
    the ranks travel repeated."""
    job = JobSpec(global_batch=2, seq_len=1024, precision="bf16")
    model = gpt_config("llama-small", n_head=8, n_kv_head=2)
    plan = Plan(dp=2, cp=4, cp_impl="ulysses")
    (a2a,) = [c for c in step_collectives(model, CLUSTER, job, plan) if c.axis is Axis.CP]
    per_pass = 1 * 256 * (2 * 384 + 2 * 48 * 4) * 2              # kv width 2 heads x 48 repeated to 4 heads
    assert a2a.op is Op.ALL_TO_ALL and a2a.calls == 2 * model.n_layer * plan.grad_accum(job)
    assert a2a.sent_bytes == pytest.approx(per_pass * 3 / 4 * a2a.calls, rel=1e-12)


def test_ring_hides_behind_attention_ulysses_does_not() -> None:
    job = JobSpec(global_batch=2, seq_len=32768)
    ring = step_time(LLAMA, CLUSTER, job, Plan(dp=2, cp=4))
    ulysses = step_time(model_preset("llama-7b"), CLUSTER, job, Plan(dp=2, cp=4, cp_impl="ulysses"))
    ring_traffic = sum(c.total_seconds for c in step_collectives(LLAMA, CLUSTER, job, Plan(dp=2, cp=4))
                       if c.axis is Axis.CP)
    assert 0 <= ring.cp_comm_s < ring_traffic
    traffic = sum(c.total_seconds for c in step_collectives(model_preset("llama-7b"), CLUSTER, job,
                                                            Plan(dp=2, cp=4, cp_impl="ulysses")) if c.axis is Axis.CP)
    assert ulysses.cp_comm_s == pytest.approx(traffic) and traffic > 0
    no_overlap = step_time(LLAMA, CLUSTER.replace(comm_overlap=0.0), job, Plan(dp=2, cp=4))
    assert no_overlap.cp_comm_s == pytest.approx(ring_traffic)


def test_layout_rules_of_cp() -> None:
    job = JobSpec(global_batch=8, seq_len=1000)                    # 1000 = 8 x 125: not 2 x 8 chunks
    reasons = lambda plan, model=LLAMA: {p.reason for p in layout_problems(model, CLUSTER, job, plan)}  # noqa: E731
    assert Reason.CP_SEQUENCE in reasons(Plan(dp=1, cp=8))
    assert Reason.CP_SEQUENCE not in reasons(Plan(dp=1, cp=8, cp_impl="ulysses"))   # 8 contiguous parts
    assert Reason.CP_HEADS in reasons(Plan(dp=2, cp=4, cp_impl="ulysses"))           # 6 heads over 4 ranks
    assert Reason.CP_HEADS not in reasons(Plan(dp=4, cp=2, cp_impl="ulysses"))
    assert Reason.WORLD_SIZE in reasons(Plan(dp=8, cp=2))


def test_search_uses_cp_only_when_the_sequence_does_not_fit_otherwise() -> None:
    model = model_preset("llama-7b")
    short = search(model, CLUSTER, JobSpec(global_batch=8))
    assert short.best is not None and all(e.plan.cp == 1 for e in short.ranked)
    long = search(model, CLUSTER, JobSpec(global_batch=8, seq_len=131072))
    assert long.best is not None and long.best.plan.cp > 1
    assert not any(e.plan.tp == 1 and e.plan.pp == 1 and e.plan.cp == 1 for e in long.ranked)
    chosen = evaluate(model, CLUSTER, JobSpec(global_batch=8, seq_len=131072), long.best.plan)
    assert chosen.feasible and chosen.memory is not None and chosen.memory.fits


def test_exported_config_carries_the_cp_block_and_loads() -> None:
    job = JobSpec(global_batch=8, seq_len=131072)
    plan = Plan(dp=4, cp=2, recompute=Recompute.FULL, zero_stage=1)
    config = deepspeed_config(plan, job)
    assert config["context_parallel"] == {"size": 2, "impl": "ring"}
    loaded = load_config_for_world(config, world_size=8)
    assert loaded.batch.micro_batch * loaded.batch.grad_accum * 4 == 8


def test_plan_command_with_seq_picks_cp(capsys, tmp_path) -> None:
    assert main(["plan", "--model", "llama-7b", "--seq", "131072", "--gpus", "8", "--global-batch", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["seq_len"] == 131072 and out["plan"]["plan"]["cp"] > 1
    assert any(c["axis"] == "cp" for c in out["communication"])
    assert main(["plan", "--model", "llama-7b", "--seq", "131072", "--gpus", "8", "--global-batch", "8",
                 "--cp", "4", "--cp-impl", "ulysses", "--zero", "3", "--recompute", "full", "--flash-attention",
                 "--json"]) == 0
    given = json.loads(capsys.readouterr().out)["plan"]
    assert (given["plan"]["dp"], given["plan"]["cp"], given["plan"]["cp_impl"]) == (2, 4, "ulysses")
    assert math.isfinite(given["step_time"]["cp_comm_s"]) and given["step_time"]["cp_comm_s"] > 0
