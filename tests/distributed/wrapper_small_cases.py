"""The module wrappers on small modules, run inside test_wrappers.py's 2-rank launch: refusals (one line each,
naming the argument and the fix), mixed-precision casts, and the shapes row sharding must get right (a scalar,
uneven rows, a row on one rank only), trained against one process and saved as sharded state dicts (DTensors;
the scalar replicated) that round-trip into a fresh model."""

from __future__ import annotations

import torch
import torch.distributed as dist

import wrapper_state_cases
from test_dp_parity import SEQ
from shardwise.testing import assert_state_close, state_copy, tiny_gpt

ADAMW = ("adamw", dict(lr=3e-3, weight_decay=0.1))
SGD = ("sgd", dict(lr=0.05, momentum=0.9))
NANOGPT = ("nanogpt", dict(lr=3e-3, weight_decay=0.1))


def optimizer(spec: tuple, params) -> torch.optim.Optimizer:
    name, kw = spec
    if name == "nanogpt":           # nanoGPT's configure_optimizers: decay matrices and embeddings only
        params = list(params)
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": kw["weight_decay"]},
                                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=kw["lr"])
    return torch.optim.AdamW(params, **kw) if name == "adamw" else torch.optim.SGD(params, **kw)


def refusals() -> list[str]:
    """One line each, naming the argument and the fix."""
    import shardwise
    from shardwise.errors import UserError
    model = tiny_gpt(seq_len=SEQ)
    attempts = [
        lambda: shardwise.fully_shard(model.blocks[0], reshard_after_forward=3),     # does not divide 2 ranks
        lambda: shardwise.fully_shard(model.blocks[0], mp_policy={"param_dtype": torch.bfloat16}),
        lambda: (shardwise.fully_shard(model), shardwise.fully_shard(model.blocks[1])),
        lambda: shardwise.fully_shard(model),
        lambda: model.clip_grad_norm_(1.0, norm_type=1),
        lambda: shardwise.DistributedDataParallel(tiny_gpt(seq_len=SEQ), all_reduce="tree"),
        lambda: shardwise.FullyShardedDataParallel(tiny_gpt(seq_len=SEQ), sharding_strategy="NO_SHARD"),
        lambda: shardwise.FullyShardedDataParallel(tiny_gpt(seq_len=SEQ), auto_wrap_policy=3),
    ]
    out = []
    for attempt in attempts:
        try:
            attempt()
            out.append("accepted")
        except UserError as e:
            out.append(str(e))
    return out


class _Scaled(torch.nn.Module):
    """A linear layer times a buffer, noting the dtype its input arrives in."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.seen: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.dtype
        return self.lin(x) * self.scale


def policy_casts() -> dict:
    """param_dtype casts the gathered weights and the inputs, buffer_dtype the buffers once, output_dtype the
    outputs; the parameters the optimizer sees stay fp32 pieces."""
    import shardwise
    net = _Scaled()
    shardwise.fully_shard(net, mp_policy=shardwise.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, output_dtype=torch.float32, buffer_dtype=torch.bfloat16))
    out = net(torch.ones(2, 4))
    out.sum().backward()              # the root stays gathered from forward to backward, as FSDP2's does
    params = list(net.parameters())
    return {"buffer": net.scale.dtype, "input": net.seen, "output": out.dtype,
            "params": sorted({str(t.dtype) for p in params for t in (p, p.grad)}),
            "numel": sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)}


class _OddShapes(torch.nn.Module):
    """Shapes row sharding must get right on 2 ranks: a scalar (rank 0 only), 3 rows (2 + 1), 1 row (none on
    rank 1), a vector of 3."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.w = torch.nn.Parameter(torch.randn(3, 5, generator=g))
        self.row = torch.nn.Parameter(torch.randn(1, 3, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(3, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # x [b, 5]
        return ((x @ self.w.T + self.bias + self.row) * self.scale).square().mean()


def odd_shapes(dp: int = 1, dp_rank: int = 0) -> dict:
    """3 AdamW steps with nanoGPT's groups on the batch [4, 5]; on dp ranks, fully_shard and this rank's rows."""
    import shardwise
    net = _OddShapes()
    if dp > 1:
        shardwise.fully_shard(net)
    # this rank's rows (a DTensor parameter's local tensor)
    shapes = {n: tuple((p.to_local() if hasattr(p, "to_local") else p).shape) for n, p in net.named_parameters()}
    opt = optimizer(NANOGPT, net.parameters())
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(4))
    for step in range(3):
        opt.zero_grad()
        net(x[step].chunk(dp)[dp_rank]).backward()
        opt.step()
    out = {"shapes": shapes, "state": net.full_state_dict() if dp > 1 else state_copy(net)}
    if dp > 1:      # the sharded state dicts (DTensors; the scalar replicated) round-trip into a fresh model
        saved = shardwise.get_state_dict(net, opt)
        fresh = shardwise.fully_shard(_OddShapes())
        fresh_opt = optimizer(NANOGPT, fresh.parameters())
        shardwise.set_state_dict(fresh, fresh_opt, model_state_dict=saved[0], optim_state_dict=saved[1])
        out["sharded"] = wrapper_state_cases.portable((saved, shardwise.get_state_dict(fresh, fresh_opt)))
    return out


def two_ranks() -> dict:
    return {"refusals": refusals(), "casts": policy_casts(), "odd_shapes": odd_shapes(dist.get_world_size(),
                                                                                      dist.get_rank())}


def check(results: list[dict]) -> None:
    r0 = results[0]
    odd = odd_shapes()
    assert [r["odd_shapes"]["shapes"] for r in results] == [{"scale": (), "w": (2, 5), "row": (1, 3), "bias": (2,)},
                                                            {"scale": (0,), "w": (1, 5), "row": (0, 3), "bias": (1,)}]
    for rank, r in enumerate(results):
        assert_state_close(r["odd_shapes"]["state"], odd["state"], what=f"odd shapes, rank {rank}")
        (msd, osd), again = r["odd_shapes"]["sharded"]
        wrapper_state_cases._assert_equal(again, (msd, osd), f"odd shapes, sharded round trip, rank {rank}")
        kind, scale, shape, placements = msd["scale"]
        assert (kind, shape, placements) == ("DTensor", (), "(Replicate(),)")
        assert torch.equal(scale, results[0]["odd_shapes"]["state"]["scale"]), "rank 0's value on every rank"
        assert msd["w"][2:] == ((3, 5), "(Shard(dim=0),)") and msd["w"][1].shape == ((2, 5), (1, 5))[rank]
        assert osd["state"]["scale"]["exp_avg"][:1] == ("DTensor",) and osd["state"]["scale"]["step"].shape == ()
    expected = ["reshard_after_forward = 3", "mp_policy = {", "already sharded by a module above it",
                "GPT is already wrapped", "norm_type = 1", "all_reduce = 'tree'", "sharding_strategy = NO_SHARD",
                "auto_wrap_policy = 3"]
    for message, start in zip(r0["refusals"], expected):
        assert start in message and "\n" not in message, (start, message)
    casts = r0["casts"]
    assert (casts["buffer"], casts["input"], casts["output"]) == (torch.bfloat16, torch.bfloat16, torch.float32)
    assert casts["params"] == ["torch.float32"] and casts["numel"] == 10          # 20 parameters over 2 ranks
