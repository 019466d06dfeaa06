"""`GradNormReducer.agree`: the step's overflow count, norm and extra in one float64 all-reduce per group, read with
one host copy; the same values as the separate norm / overflow paths (`test_grad_norm.py`'s stand-in groups)."""

from __future__ import annotations

import math

import torch

from shardwise.parallel.grad_norm import GradNormReducer, ExtraSums, shard_layout, whole_tensor_layout
from test_grad_norm import PeerComm, _param, _solo


def test_alone_is_torch_clip_bitwise_and_extra_sums_go_over_their_group() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for t, p in zip(twins, params):
        t.grad = p.grad.clone()
    bound = GradNormReducer(stage_comm=_solo(), model_comm=_solo(), tp_comm=_solo()).for_tensors(
        whole_tensor_layout(params), dp_sharded=False)
    dp = PeerComm(peer=lambda t: torch.tensor([2.5], dtype=t.dtype))
    extra = ExtraSums(torch.tensor([1.5]), dp)
    verdict = bound.agree(params, check_overflow=True, want_norm=True, extra=extra)
    bound.clip_with_norm_(params, 1.0, verdict.norm)
    overflow, norm, sums = verdict.read()
    want = float(torch.nn.utils.clip_grad_norm_(twins, 1.0))
    assert (overflow, norm, sums) == (False, want, [4.0]) and dp.calls == [1]
    assert all(torch.equal(p.grad, t.grad) for p, t in zip(params, twins))


def test_zero_fuses_squares_flag_and_extra_sums_over_the_model_group() -> None:
    class Layout:
        @staticmethod
        def pieces_in_shard(rank):
            return [(0, 0, 2, 0), (1, 0, 2, 2)]

    class Bucket:
        params = [_param([0.0, 0.0], sliced=True), _param([0.0, 0.0], sliced=False)]
        layout, rank = Layout(), 0

    shard = torch.nn.Parameter(torch.zeros(4))
    shard.grad = torch.tensor([1.0, 2.0, 3.0, 4.0])               # sliced 5, replicated 25
    # the other dp shard: sliced 10, replicated 7, its overflow flag 1, its loss 0.5
    model_group = PeerComm(peer=lambda t: torch.tensor([10.0, 7.0, 1.0, 0.5], dtype=t.dtype))
    tp = PeerComm(peer=lambda t: torch.tensor([100.0, 0.0], dtype=t.dtype))   # the other TP slice: 100, no flag
    bound = GradNormReducer(stage_comm=_solo(), model_comm=model_group, tp_comm=tp).for_tensors(
        shard_layout([Bucket()]), dp_sharded=True)
    extra = ExtraSums(torch.tensor([0.25]), model_group)                # same group: fused into the one all-reduce
    overflow, norm, sums = bound.agree([shard], check_overflow=True, want_norm=True, extra=extra).read()
    assert overflow and sums == [0.75]
    assert math.isclose(norm, math.sqrt(15.0 + 100.0 + 32.0), rel_tol=1e-15)
    assert model_group.calls == [4] and tp.calls == [2]


def test_clip_coefficient_on_the_device_matches_the_host_rule() -> None:
    shard = torch.nn.Parameter(torch.zeros(2))
    shard.grad = torch.tensor([3.0, 4.0])
    peer = PeerComm()                               # a second holder with nothing: norm 5
    bound = GradNormReducer(stage_comm=_solo(), model_comm=peer, tp_comm=_solo()).for_tensors(
        [()], dp_sharded=True)
    verdict = bound.agree([shard], check_overflow=False, want_norm=True)
    bound.clip_with_norm_([shard], 1.0, verdict.norm)
    coef = 1.0 / (5.0 + 1e-6)
    assert torch.equal(shard.grad, torch.tensor([3.0, 4.0]) * torch.tensor(coef, dtype=torch.float32))
    assert verdict.read() == (False, 5.0, [])
