"""Stage 0's GPU-minded defaults: DDP's 25 MB gradient buckets unless the config sets reduce_bucket_size, and the
masters' copies and update as multi-tensor kernels (one launch each, the fused Adam that ZeRO uses)."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.comm.ledger import CommLedger
from shardwise.config import load_config_for_world
from shardwise.config import resolved
from shardwise.config.resolved import DEFAULT_BUCKET_BYTES, LAST_BUCKET_DIVISOR, DataParallelConfig
from shardwise.parallel.data_parallel import BucketedAllReduce
from shardwise.parallel.grad_norm import GradNormReducer
from shardwise.parallel.replicated import build_replicated
from shardwise.parallel.update import UpdateRecipe
from shardwise.planner.memory import gradient_buckets
from shardwise.parallel.precision import LossScaler
from shardwise.comm.topology import SoloComm

BASE = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_bucket_size_default_is_25mb_unless_the_config_sets_it() -> None:
    assert load_config_for_world(dict(BASE), world_size=1).data_parallel.bucket_numel is None
    given = load_config_for_world(dict(BASE, zero_optimization={"reduce_bucket_size": 5e8}), world_size=1)
    assert given.data_parallel.bucket_numel == 500_000_000
    assert DEFAULT_BUCKET_BYTES == 25 * 1024 * 1024


@pytest.mark.parametrize("dtype, expect", [(torch.float32, [[0], [1], [2]]), (torch.bfloat16, [[0, 1], [2]])])
def test_default_buckets_hold_25mb_of_their_dtype(dtype: torch.dtype, expect: list[list[int]]) -> None:
    # 5M elements each: 20 MB in fp32 (two exceed 25 MB), 10 MB in bf16 (two fit, three do not)
    params = [torch.nn.Parameter(torch.empty(5 << 20, dtype=dtype, device="meta")) for _ in range(3)]
    groups = BucketedAllReduce._group_by_dtype(params, None)
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in g] for g in groups] == expect
    # an explicit size is kept (16M elements hold all three), except that the last bucket holds a quarter of it
    explicit = BucketedAllReduce._group_by_dtype(params, 16 << 20)
    assert [[index[id(p)] for p in g] for g in explicit] == [[0, 1], [2]]


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_planner_buckets_stage_0_as_the_engine_does(monkeypatch: pytest.MonkeyPatch, precision: str,
                                                        dtype: torch.dtype) -> None:
    from shardwise.planner import JobSpec, Plan, cluster_preset, model_preset
    from shardwise.planner.comm import dp_collectives
    from shardwise.planner.flops import params_per_rank
    model, cluster = model_preset("1.3b"), cluster_preset("h100-80gb", num_gpus=8)
    job = JobSpec(global_batch=64, precision=precision)
    for cap in (DEFAULT_BUCKET_BYTES, 1 << 20):     # both follow the one rule, whatever the default is
        monkeypatch.setattr(resolved, "DEFAULT_BUCKET_BYTES", cap)
        numel = cap // dtype.itemsize
        [allreduce] = dp_collectives(model, cluster, job, Plan(dp=8))
        # the last bucket holds a quarter of the size, the others are full
        last = numel // LAST_BUCKET_DIVISOR
        assert allreduce.messages == 1 + math.ceil((params_per_rank(model) - last) / numel) > 1
        params = [torch.nn.Parameter(torch.empty(numel // 2, dtype=dtype, device="meta")) for _ in range(4)]
        assert [len(g) for g in BucketedAllReduce._group_by_dtype(params, None)] == [1, 2, 1]
        assert gradient_buckets(2 * numel, job, Plan(dp=8)) == 3


def test_stage0_masters_copy_with_one_kernel_each_way_and_step_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    groups = [{"params": list(model.parameters())}]
    solo = SoloComm(None, CommLedger(), name="dp")
    recipe = UpdateRecipe(make_optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2), scaler=LossScaler(),
                          clip=1.0, check_overflow=True, dtype=torch.bfloat16)
    norms = GradNormReducer(stage_comm=solo, model_comm=solo, tp_comm=solo)
    update, runtime = build_replicated(groups, section=DataParallelConfig(bucket_numel=None), recipe=recipe,
                                       dp_comm=solo, norms=norms)
    assert all(g["fused"] for g in update.optimizer.param_groups)
    for p in model.parameters():
        p.grad.copy_(torch.randn_like(p))
    calls: list[int] = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: calls.append(len(dst)) or real(dst, src))
    before = [m.detach().clone() for m in update.masters]
    assert update.step()
    assert calls == [4, 4]                      # gradients into the masters, masters into the model
    for p, m, b in zip(model.parameters(), update.masters, before):
        assert not torch.equal(m, b) and torch.equal(p, m.to(torch.bfloat16))
    runtime.close()
