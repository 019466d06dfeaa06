"""torch DDP's communication hooks on shardwise's DistributedDataParallel: torch's own hooks run unchanged on our
buckets and give what they give under torch's DDP.

fp16 compression is element-wise (cast, divide by the world size, sum, cast back), so the bucket boundaries
do not matter and both wrappers must agree bitwise; torch's plain `allreduce_hook` (divide, then sum) is the
wrapper's own arithmetic, so it must equal the run without a hook bitwise. (PowerSGD chains collectives from
future callbacks, which hangs on gloo under torch's own DDP too, so it is not run here.)

Also in this launch: a parameter that gets no gradient in some steps of a `zero_grad()` (set_to_none) loop,
against the single process; BatchNorm buffers kept in step as torch DDP keeps them, one broadcast per dtype."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from test_dp_parity import SEQ
from test_wrappers import seed_loop
from shardwise.testing import run_distributed, state_copy, tiny_gpt


def _train(wrapper: str, hook: str) -> dict:
    import shardwise
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    net = tiny_gpt(seq_len=SEQ)
    model = shardwise.DistributedDataParallel(net, bucket_cap_mb=0.01) if wrapper == "ours" \
        else DDP(net, bucket_cap_mb=0.01)
    if hook != "none":
        model.register_comm_hook(None, {"fp16": default_hooks.fp16_compress_hook,
                                        "allreduce": default_hooks.allreduce_hook}[hook])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = seed_loop(model, opt, gas=1, dp=dist.get_world_size(), dp_rank=dist.get_rank())
    return {"losses": losses, "state": state_copy(net)}


class _Branchy(torch.nn.Module):
    """`a` always trains; `b` only on even steps: a bucket of the DDP wrapper gets no gradient for it on odd ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if self.steps % 2 == 0:
            y = self.b(y)
        self.steps += 1
        return y.square().mean()


def _branchy(world: int, rank: int, wrap: bool) -> dict:
    import shardwise
    net = _Branchy()
    # b goes unused on odd steps: torch DDP's find_unused_parameters=True (without it the next forward raises)
    model = shardwise.DistributedDataParallel(net, bucket_cap_mb=1e-4, find_unused_parameters=True) if wrap \
        else net
    # plain SGD: a zero gradient and no gradient step alike, so stale slot values would show
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        x = torch.randn(4 * 2, 8, generator=g)
        opt.zero_grad()         # set_to_none: the wrapper's buckets start fresh each step
        loss = model(x.chunk(world)[rank])
        loss.backward()
        opt.step()
    return {"state": state_copy(net)}


class _Normed(torch.nn.Module):
    """Two BatchNorms: float running stats and an int64 batch count per layer, which each rank updates from its
    own data; DDP broadcasts rank 0's at every forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a, self.bn1 = torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6)
        self.b, self.bn2 = torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.b(self.bn1(self.a(x)))).square().mean()


def _buffers(wrapper: str) -> dict:
    import shardwise
    from torch.nn.parallel import DistributedDataParallel as DDP
    net = _Normed()
    model = shardwise.DistributedDataParallel(net, bucket_cap_mb=1e-4) if wrapper == "ours" \
        else DDP(net, bucket_cap_mb=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(6 + dist.get_rank())       # each rank its own data, so its own stats
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 6, generator=g)).backward()
        opt.step()
    return {"state": {k: v.clone() for k, v in net.state_dict().items()},
            "report": model.comm_report() if wrapper == "ours" else None}


def _worker() -> dict:
    out = {"branchy": _branchy(dist.get_world_size(), dist.get_rank(), True),
           "buffers": {w: _buffers(w) for w in ("ours", "torch")}}
    out.update({f"{w}/{h}": _train(w, h) for w, h in [("ours", "fp16"), ("torch", "fp16"), ("ours", "none"),
                                                  ("ours", "allreduce")]})
    import shardwise
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model = shardwise.DistributedDataParallel(tiny_gpt(seq_len=SEQ), bucket_cap_mb=0.01)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    errors = []
    try:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    except shardwise.UserError as e:
        errors.append(str(e))
    ring = shardwise.DistributedDataParallel(tiny_gpt(seq_len=SEQ), bucket_cap_mb=0.01, all_reduce="ring")
    try:
        ring.register_comm_hook(None, default_hooks.allreduce_hook)
    except shardwise.UserError as e:
        errors.append(str(e))
    out["errors"] = errors
    return out


@pytest.mark.timeout(240)
def test_torch_comm_hooks_run_on_our_buckets() -> None:
    r0, r1 = run_distributed(_worker, 2)
    # compression: bitwise torch DDP's result with the same hook, and not the exact all-reduce's
    for dtype in ("fp16",):     # torch's bf16 hook asks for NCCL
        assert r0[f"ours/{dtype}"]["losses"] == r0[f"torch/{dtype}"]["losses"], dtype
        for k, v in r0[f"ours/{dtype}"]["state"].items():
            assert torch.equal(v, r0[f"torch/{dtype}"]["state"][k]), (dtype, k)
        assert any(not torch.equal(v, r0["ours/none"]["state"][k]) for k, v in r0[f"ours/{dtype}"]["state"].items())
    for k, v in r0["ours/allreduce"]["state"].items():
        assert torch.equal(v, r0["ours/none"]["state"][k]), k
    for name in ("ours/fp16", "ours/allreduce"):
        for k, v in r0[name]["state"].items():     # the replicas stay identical
            assert torch.equal(v, r1[name]["state"][k]), (name, k)
    # a parameter without a gradient in a step: its slot is zeroed, not last step's values (plain SGD: the single
    # process, where it has no gradient, does not move it either)
    ref = _branchy(1, 0, False)["state"]
    for r in (r0, r1):
        for k, v in ref.items():
            torch.testing.assert_close(r["branchy"]["state"][k], v, rtol=1e-6, atol=1e-7)
    assert len(r0["errors"]) == 2 and "already registered" in r0["errors"][0] and "ring" in r0["errors"][1]
    # buffers: rank 0's broadcast at every forward, as torch DDP (bitwise), one broadcast per dtype
    for r in (r0, r1):
        ours, theirs = r["buffers"]["ours"]["state"], r["buffers"]["torch"]["state"]
        assert ours.keys() == theirs.keys()
        for k, v in theirs.items():
            assert torch.equal(ours[k], v), k
    assert not torch.equal(r0["buffers"]["ours"]["state"]["bn1.running_mean"], _Normed().bn1.running_mean)
    broadcasts = {row["dtype"]: row["count"] for row in r0["buffers"]["ours"]["report"] if row["op"] == "broadcast"}
    assert broadcasts == {"float32": 1, "int64": 1}, broadcasts      # running stats, batch counts
