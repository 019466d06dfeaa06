"""GradNormReducer's arithmetic, one process: which elements count once, which are summed over which group.

The collectives are stood in for by `PeerComm`, a group of two whose other member holds given values, so the
reduction over holders and over TP can be checked against the whole model's norm computed directly."""

from __future__ import annotations

import math

import torch

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.parallel.grad_norm import GradNormReducer, shard_layout, whole_tensor_layout
from shardwise.parallel.tensor_parallel.layers import TP_DIM_ATTR


class PeerComm(Comm):
    """Two ranks: this one and a peer whose all-reduce input is `peer(t)` (max for flags, sum otherwise)."""

    def __init__(self, peer=lambda t: torch.zeros_like(t), flag: float = 0.0):
        super().__init__(None, CommLedger(), name="peer")
        self.peer, self.flag, self.calls = peer, flag, []

    @property
    def size(self) -> int:
        return 2

    @property
    def rank(self) -> int:
        return 0

    def all_reduce(self, tensor, op=None, async_op=False):
        self.calls.append(tensor.numel())
        tensor += self.peer(tensor)

    def all_reduce_object_max(self, value: float) -> float:
        self.calls.append(1)
        return max(value, self.flag)


def _solo() -> Comm:
    from shardwise.comm.topology import SoloComm
    return SoloComm(None, CommLedger(), name="solo")


def _param(values: list[float], sliced: bool) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(len(values)))
    p.grad = torch.tensor(values)
    if sliced:
        setattr(p, TP_DIM_ATTR, 0)
    return p


def test_alone_is_torch_clip_grad_norm_bitwise():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    ref = [p.grad.clone() for p in params]
    norms = GradNormReducer(stage_comm=_solo(), model_comm=_solo(), tp_comm=_solo())
    bound = norms.for_tensors(whole_tensor_layout(params), dp_sharded=False)
    assert bound.alone
    got = bound.clip_(params, 1.0)
    twins = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref]
    for t, g in zip(twins, ref):
        t.grad = g.clone()
    want = float(torch.nn.utils.clip_grad_norm_(twins, 1.0))
    assert got == want
    for p, t in zip(params, twins):
        assert torch.equal(p.grad, t.grad)


def test_stage0_under_tp_counts_replicated_once_and_sums_slices():
    # this TP rank: a slice [3, 4] and a replicated norm weight [1, 2]; the peer TP rank holds slice [12, 0]
    # and the same replicated gradient. Whole model: 3^2 + 4^2 + 12^2 + 1^2 + 2^2 = 174.
    sliced, replicated = _param([3.0, 4.0], sliced=True), _param([1.0, 2.0], sliced=False)
    tp = PeerComm(peer=lambda t: torch.tensor([144.0], dtype=t.dtype))
    norms = GradNormReducer(stage_comm=_solo(), model_comm=_solo(), tp_comm=tp)
    bound = norms.for_tensors(whole_tensor_layout([sliced, replicated]), dp_sharded=False)
    assert math.isclose(bound.norm([sliced, replicated]), math.sqrt(174.0), rel_tol=1e-15)
    assert tp.calls == [1]                      # only the sliced part crosses TP: 8 bytes


def test_zero_shards_sum_over_holders_then_slices_over_tp():
    # One flat shard [4] mixing a TP slice (elements 0..1) and a replicated parameter (elements 2..3).
    class Layout:
        @staticmethod
        def pieces_in_shard(rank):          # (param index, lo, hi, destination in the shard)
            return [(0, 0, 2, 0), (1, 0, 2, 2)]

    class Bucket:
        params = [_param([0.0, 0.0], sliced=True), _param([0.0, 0.0], sliced=False)]
        layout, rank = Layout(), 0

    shard = torch.nn.Parameter(torch.zeros(4))
    shard.grad = torch.tensor([1.0, 2.0, 3.0, 4.0])          # sliced 1 + 4 = 5, replicated 9 + 16 = 25
    holders = PeerComm(peer=lambda t: torch.tensor([10.0, 7.0], dtype=t.dtype))   # the other dp shard's parts
    tp = PeerComm(peer=lambda t: torch.tensor([100.0], dtype=t.dtype))            # the other TP slice's sum
    norms = GradNormReducer(stage_comm=_solo(), model_comm=holders, tp_comm=tp)
    bound = norms.for_tensors(shard_layout([Bucket()]), dp_sharded=True)
    assert bound.layout == (((2, 4),),)
    # sliced: (5 + 10) over holders, + 100 from the TP peer; replicated: 25 + 7, counted once
    assert math.isclose(bound.norm([shard]), math.sqrt(15.0 + 100.0 + 32.0), rel_tol=1e-15)
    assert holders.calls == [2] and tp.calls == [1]


def test_overflow_is_agreed_over_holders_and_tp():
    quiet, loud = PeerComm(flag=0.0), PeerComm(flag=1.0)
    assert GradNormReducer(stage_comm=_solo(), model_comm=quiet, tp_comm=loud).for_tensors(
        [()], dp_sharded=True).overflow(False)
    assert GradNormReducer(stage_comm=loud, model_comm=quiet, tp_comm=_solo()).for_tensors(
        [()], dp_sharded=False).overflow(False)
    assert not GradNormReducer(stage_comm=loud, model_comm=quiet, tp_comm=_solo()).for_tensors(
        [()], dp_sharded=True).overflow(False)       # ZeRO: the stage group is not the holders' group
