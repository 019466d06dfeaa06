"""The wrappers' parameters as torch code sees them, against torch's own FSDP2 and DDP on gloo, in one launch per
world size:

- `fully_shard`'s parameters are DTensors (Shard(0) over the dp mesh) with FSDP2's local rows, so the habitual
  `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` returns the whole model's norm and clips alike on
  every rank: the same norms, losses and parameters as FSDP2 after several AdamW steps (at 2 ranks and at 4).
- A submodule that a backward does not reach keeps `.grad` None, so Adam does not move it on momentum (torch's
  FSDP2 test of a forward and backward through a non-root module, then `zero_grad(set_to_none=False)`, where
  zeros are kept and Adam does move them).
- `DistributedDataParallel(find_unused_parameters=True)`: a parameter no rank used in a step keeps None and AdamW's
  weight decay leaves it alone; one used on one rank only, or in one micro-batch of an accumulation, is averaged:
  torch DDP's gradients and parameters, step by step. A DDP model pickles (`torch.save(model)`) and trains on.
- torch's own `get_state_dict` / `set_state_dict` with `torch.distributed.checkpoint` save and resume a
  fully_shard model and its optimizer exactly.
- FSDP2's explicit prefetching (`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`) and
  `shard_placement_fn` (Shard(0); a dim that does not split evenly refused in one line, as FSDP2 refuses it):
  FSDP2's losses and parameters. So with `shard_placement_fn` cutting along each parameter's largest dim
  (Shard(1) too: FSDP2's placements, contiguous parameters and gradients, a sharded state dict loading back), with
  `reshard_after_forward=None` (the root kept gathered after forward, the blocks freed), and with the model cast
  to float64 after wrapping (`.to(torch.float64)`, `.double()`).
- `DistributedDataParallel` without `find_unused_parameters`: after a backward that left a parameter without a
  gradient, the next forward raises a RuntimeError naming the fix, as torch DDP's.
- At 4 ranks, an int `reshard_after_forward` (2: a smaller group; 1: kept gathered) and an explicit True (the
  root's parameters freed after forward too) against FSDP2's; tensor parallelism composed as torchtitan does, a
  (dp, tp) = (2, 2) DeviceMesh, `shardwise.parallelize_module(model, mesh["tp"], plan)`, then `fully_shard(..., mesh=mesh["dp"])`: the GPT with
  its own plan against one process (norms from torch's clip_grad_norm_, losses, the whole parameters read back
  with `full_tensor()`), and a plan written in torch's styles against torch's own parallelize_module + FSDP2
  (the same placements, norms, losses and parameters), applied by shardwise's parallelize_module, or by torch's
  under shardwise's fully_shard (also with activation checkpointing of each block).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

from test_dp_parity import SEQ, global_batches
from shardwise.testing import (
    assert_close_lists, assert_state_close, lm_pair, mean_over_ranks, run_distributed, shard_global_batch, tiny_gpt,
)

LR, WEIGHT_DECAY, CLIP = 3e-3, 0.1, 0.5
FP32 = dict(rtol=1e-5, atol=1e-5)
FP64 = dict(rtol=1e-12, atol=1e-12)


def _fully_shard_fn(which: str):
    if which == "torch":
        from torch.distributed.fsdp import fully_shard
        return fully_shard
    import shardwise
    return shardwise.fully_shard


def _clip_with_torch(which: str) -> dict:
    """Every block, then the root; torch's clip_grad_norm_ on model.parameters() before each AdamW step."""
    fully_shard = _fully_shard_fn(which)
    model = tiny_gpt(seq_len=SEQ)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    world, rank = dist.get_world_size(), dist.get_rank()
    losses, norms = [], []
    for b in global_batches():
        (rows,) = shard_global_batch(b, dp_size=world, dp_rank=rank, grad_accum=1)
        loss = model(*lm_pair(rows))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(float(loss.detach())))
    from torch.distributed.tensor import DTensor
    params = {n: (type(p).__name__, tuple(p.shape), str(p.placements) if isinstance(p, DTensor) else None,
                  tuple(p.to_local().shape) if isinstance(p, DTensor) else None) for n, p in model.named_parameters()}
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params, "state": state}


class _MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.in_proj = nn.Linear(dim, 4 * dim)
        self.out_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def _non_root(which: str) -> dict:
    """FSDP2's test: a step through the root, then steps through model[0] alone; the other MLPs get no gradient."""
    fully_shard = _fully_shard_fn(which)
    torch.manual_seed(42)
    model = nn.Sequential(*[_MLP(8) for _ in range(3)])
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank())
    x = torch.randn(8, 8)
    missing = []
    model(x).sum().backward()
    opt.step()
    for set_to_none in (False, True):           # zeros kept (Adam moves them), then None (it does not)
        opt.zero_grad(set_to_none=set_to_none)
        model[0](x).sum().backward()
        missing.append([p.grad is None for p in model.parameters()])
        opt.step()
    return {"missing": missing, "out": model(x).detach(),
            "state": {k: v.full_tensor() for k, v in model.state_dict().items()}}


class _Branches(nn.Module):
    """`b` takes part only when the step asks for it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if use_b:
            h = h + self.b(h)
        return self.head(h).square().mean()


# per step, per micro-batch: the ranks that use b
_DDP_STEPS = [[(0, 1)], [()], [(0,)], [()], [(0, 1), ()], [(), ()]]


def _ddp_unused(which: str) -> dict:
    torch.manual_seed(3)
    net = _Branches()
    if which == "torch":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net, find_unused_parameters=True)
    else:
        import shardwise
        model = shardwise.DistributedDataParallel(net, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank = dist.get_rank()
    x = torch.randn(len(_DDP_STEPS), 2, 4, 8, generator=torch.Generator().manual_seed(5 + rank))
    missing, states = [], []
    for step, micro in enumerate(_DDP_STEPS):
        for k, users in enumerate(micro):
            last = k == len(micro) - 1
            with model.no_sync() if not last else contextlib.nullcontext():
                (model(x[step, k], rank in users) / len(micro)).backward()
        missing.append([p.grad is None for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        states.append({k: v.detach().clone() for k, v in net.state_dict().items()})
    return {"missing": missing, "states": states}


def _explicit_prefetch(which: str) -> dict:
    """FSDP2's explicit prefetching: each block's forward launches the next two blocks' all-gathers, its backward
    the previous two's; every parameter placed by shard_placement_fn (Shard(0))."""
    from torch.distributed.tensor import Shard
    fully_shard = _fully_shard_fn(which)
    model = tiny_gpt(seq_len=SEQ, n_layer=4)
    blocks = list(model.blocks)
    for block in blocks:
        fully_shard(block, shard_placement_fn=lambda p: Shard(0))
    fully_shard(model)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
        block.set_modules_to_backward_prefetch(blocks[max(i - 2, 0):i][::-1])
    seen: list[list[str]] = []
    if which == "ours":             # while block 0 runs, blocks 1 and 2 are gathered or gathering, not sharded
        runtime = model._fully_shard_state().runtime
        units = {id(u.module): u for u in runtime.units}
        blocks[0].register_forward_pre_hook(
            lambda *_: seen.append([units[id(b)].gather_state.name for b in blocks[1:]]))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for b in global_batches():
        (rows,) = shard_global_batch(b, dp_size=dist.get_world_size(), dp_rank=dist.get_rank(), grad_accum=1)
        loss = model(*lm_pair(rows))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(float(loss.detach())))
    refused = ""
    try:                            # the last dim of the [3, 3] weight does not split over 2 ranks
        _fully_shard_fn(which)(nn.Linear(3, 3), shard_placement_fn=lambda p: Shard(p.dim() - 1))
    except Exception as e:          # FSDP2's NotImplementedError; shardwise's one line
        refused = str(e)
    return {"losses": losses, "seen": seen, "refused": refused,
            "state": {k: v.full_tensor() for k, v in model.state_dict().items()}}


def _shard_largest_dim(which: str) -> dict:
    """FSDP2's test: `shard_placement_fn` cutting each parameter along its largest dim (Shard(1) for the first
    weight); FSDP2's placements, local shapes, contiguous parameters and gradients, losses and parameters, and
    the sharded state dict loaded back into a fresh model."""
    from torch.distributed.tensor import Shard
    fully_shard = _fully_shard_fn(which)

    def build() -> nn.Module:
        torch.manual_seed(42)
        model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 8))
        fully_shard(model[2], shard_placement_fn=lambda p: Shard(p.shape.index(max(p.shape))))
        fully_shard(model, shard_placement_fn=lambda p: Shard(p.shape.index(max(p.shape))))
        return model

    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank() + 1)
    x = torch.randn(4, 32)
    contiguous, losses = [], []
    model[2].register_forward_pre_hook(lambda m, _: contiguous.append(all(p.is_contiguous() for p in m.parameters())))
    for step in range(4):
        loss = model(x).sum()
        loss.backward()
        contiguous.append(all(t.is_contiguous() for p in model.parameters() for t in (p.to_local(), p.grad.to_local())))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        losses.append(mean_over_ranks(float(loss.detach())))
    placements = {n: (str(p.placements), tuple(p.to_local().shape)) for n, p in model.named_parameters()}
    again = build()
    again.load_state_dict(model.state_dict())
    return {"losses": losses, "placements": placements, "contiguous": contiguous,
            "state": {k: v.full_tensor() for k, v in model.state_dict().items()},
            "loaded": {k: v.full_tensor() for k, v in again.state_dict().items()}}


def _reshard_none(which: str) -> dict:
    """`reshard_after_forward=None`, FSDP2's default: the root keeps its parameters gathered after forward, the
    blocks below it free theirs; FSDP2's losses and parameters."""
    fully_shard = _fully_shard_fn(which)
    model = tiny_gpt(seq_len=SEQ)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=None)
    fully_shard(model, reshard_after_forward=None)
    flags = []
    if which == "ours":
        flags = [(u.is_root, u.reshard_after_forward) for u in model._fully_shard_state().runtime.units]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for b in global_batches()[:3]:
        (rows,) = shard_global_batch(b, dp_size=dist.get_world_size(), dp_rank=dist.get_rank(), grad_accum=1)
        loss = model(*lm_pair(rows))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(float(loss.detach())))
    return {"flags": flags, "losses": losses, "state": {k: v.full_tensor() for k, v in model.state_dict().items()}}


def _ddp_pickled() -> dict:
    """`torch.save(model)` of a DistributedDataParallel model loads back as one that trains on, averaging."""
    import io
    import shardwise
    torch.manual_seed(3)
    model = shardwise.DistributedDataParallel(_Branches(), find_unused_parameters=True)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(20 + dist.get_rank()))
    for m in (model, again):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(x, True).backward()
        opt.step()
    state = lambda m: {k: v.detach().clone() for k, v in m.module.state_dict().items()}  # noqa: E731
    return {"kind": type(again).__name__, "state": state(again), "expected": state(model)}


def _torch_dcp(path: str) -> dict:
    """torch's own `get_state_dict` / `set_state_dict` and `torch.distributed.checkpoint` on fully_shard: saved
    after one step, loaded into a model of other weights, the next steps are the ones the first run took."""
    import shardwise
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build(seed: int):
        model = tiny_gpt(seq_len=SEQ, seed=seed)
        for block in model.blocks:
            shardwise.fully_shard(block)
        shardwise.fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def step(model, opt, batch) -> float:
        (rows,) = shard_global_batch(batch, dp_size=dist.get_world_size(), dp_rank=dist.get_rank(), grad_accum=1)
        loss = model(*lm_pair(rows))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    batches = global_batches()
    model, opt = build(0)
    step(model, opt, batches[0])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    went_on = [step(model, opt, b) for b in batches[1:]]
    fresh, fresh_opt = build(5)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"went_on": went_on, "resumed": [step(fresh, fresh_opt, b) for b in batches[1:]]}


def _cast_after_init(which: str) -> dict:
    """FSDP2's test: every module wrapped, then the model cast to float64 (`.to(torch.float64)`; `.double()` on
    shardwise too); the parameters, their local shards and their gradients are float64 and train as a float64
    model does."""
    fully_shard = _fully_shard_fn(which.split("_")[0])
    torch.manual_seed(42)
    model = _MLP(4)
    for module in (model.in_proj, model.out_proj, model):
        fully_shard(module)
    opt_before = torch.optim.Adam(model.parameters(), lr=1e-2)     # built before the cast: the same objects
    model.double() if which == "ours_double" else model.to(torch.float64)
    dtypes = [(p.dtype, p.to_local().dtype, p._spec.tensor_meta.dtype) for p in model.parameters()]
    torch.manual_seed(43 + dist.get_rank())
    x = torch.randn(2, 4, dtype=torch.float64)
    losses, grad_dtypes = [], []
    for step in range(4):
        loss = model(x).sum()
        loss.backward()
        grad_dtypes.append([(p.grad.dtype, p.grad.to_local().dtype) for p in model.parameters()])
        opt_before.step()
        opt_before.zero_grad(set_to_none=step % 2 == 0)
        losses.append(mean_over_ranks(float(loss.detach())))
    return {"dtypes": dtypes, "grad_dtypes": grad_dtypes, "losses": losses,
            "state": {k: v.full_tensor() for k, v in model.state_dict().items()}}


def _ddp_unused_refused(which: str) -> str:
    """Without find_unused_parameters, a backward that leaves `b` without a gradient: torch DDP's next forward
    raises a RuntimeError naming the fix. Returns that exception's class and whether it names the fix."""
    torch.manual_seed(3)
    net = _Branches()
    if which == "torch":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net)
    else:
        import shardwise
        model = shardwise.DistributedDataParallel(net)
    x = torch.randn(4, 8)
    model(x, True).backward()           # every parameter used: no error
    model(x, False).backward()          # b unused
    try:
        model(x, True)
    except RuntimeError as e:
        return f"RuntimeError {'find_unused_parameters=True' in str(e)}"
    return "no error"


def _pairs(path: str) -> dict:
    torch.set_num_threads(1)
    out = {name: {which: fn(which) for which in ("torch", "ours")}
           for name, fn in (("clip", _clip_with_torch), ("non_root", _non_root), ("ddp_unused", _ddp_unused),
                            ("prefetch", _explicit_prefetch), ("reshard_none", _reshard_none))}
    out["largest_dim"] = {which: _shard_largest_dim(which) for which in ("torch", "ours")}
    out["cast"] = {which: _cast_after_init(which) for which in ("torch", "ours", "ours_double")}
    out["ddp_unused_refused"] = {which: _ddp_unused_refused(which) for which in ("torch", "ours")}
    return {**out, "pickled": _ddp_pickled(), "torch_dcp": _torch_dcp(path)}


def _check_clip(results: list[dict], world: int) -> None:
    for rank, r in enumerate(results):
        ours, theirs = r["clip"]["ours"], r["clip"]["torch"]
        what = f"{world} ranks, rank {rank}, clip_grad_norm_"
        # DTensors of FSDP2's global shapes, placements and local rows
        assert ours["params"] == theirs["params"], what
        assert all(kind == "DTensor" for kind, *_ in ours["params"].values()), what
        assert_close_lists(ours["norms"], theirs["norms"], rtol=1e-5, what=f"{what}: norms")
        assert min(theirs["norms"]) > CLIP, f"{what}: every step clips ({theirs['norms']})"
        assert_close_lists(ours["losses"], theirs["losses"], rtol=1e-5, what=f"{what}: losses")
        assert_state_close(ours["state"], theirs["state"], what=what, adam=True)


def test_torch_view_two_ranks(tmp_path):
    results = run_distributed(_pairs, 2, args=(str(tmp_path / "dcp"),), timeout=300)
    _check_clip(results, 2)
    for rank, r in enumerate(results):
        # the same arithmetic from the same state: exact
        assert_close_lists(r["torch_dcp"]["resumed"], r["torch_dcp"]["went_on"], rtol=0,
                           what=f"torch's get_state_dict + DCP, resumed, rank {rank}")
        ours, theirs = r["non_root"]["ours"], r["non_root"]["torch"]
        # model[1:] keep the zeros zero_grad(set_to_none=False) left, then None after zero_grad()
        assert theirs["missing"] == [[False] * 12, [False] * 4 + [True] * 8], theirs["missing"]
        assert ours["missing"] == theirs["missing"], f"rank {rank}: {ours['missing']}"
        torch.testing.assert_close(ours["out"], theirs["out"], **FP32)
        assert_state_close(ours["state"], theirs["state"], what=f"non-root, rank {rank}")
        ours, theirs = r["ddp_unused"]["ours"], r["ddp_unused"]["torch"]
        # b is None in the steps no rank used it, whatever this rank did
        b_missing = [m[2] for m in theirs["missing"]]
        assert b_missing == [False, True, False, True, False, True], b_missing
        assert ours["missing"] == theirs["missing"], f"rank {rank}: {ours['missing']}"
        for step, (mine, ref) in enumerate(zip(ours["states"], theirs["states"])):
            assert_state_close(mine, ref, what=f"DDP find_unused_parameters, rank {rank}, step {step}")
        ours, theirs = r["prefetch"]["ours"], r["prefetch"]["torch"]
        # (by default only the next block is gathered ahead)
        assert ours["seen"] and all("SHARDED" not in states[:2] for states in ours["seen"]), ours["seen"]
        assert_close_lists(ours["losses"], theirs["losses"], rtol=1e-5, what=f"explicit prefetch, rank {rank}")
        assert_state_close(ours["state"], theirs["state"], what=f"explicit prefetch, rank {rank}", adam=True)
        assert "uneven" in theirs["refused"], theirs["refused"]
        assert "shard_placement_fn gave Shard(1)" in ours["refused"] and "\n" not in ours["refused"], ours["refused"]
        ours, theirs = r["largest_dim"]["ours"], r["largest_dim"]["torch"]
        what = f"shard_placement_fn largest dim, rank {rank}"
        assert theirs["placements"]["0.weight"][0] == "(Shard(dim=1),)", theirs["placements"]
        assert ours["placements"] == theirs["placements"], (what, ours["placements"])
        assert all(ours["contiguous"]) and all(theirs["contiguous"]), (what, ours["contiguous"])
        assert_close_lists(ours["losses"], theirs["losses"], rtol=1e-5, what=what)
        assert_state_close(ours["state"], theirs["state"], what=what)
        assert_state_close(ours["loaded"], ours["state"], what=f"{what}: loaded back", rtol=0, atol=0)
        ours, theirs = r["reshard_none"]["ours"], r["reshard_none"]["torch"]
        n_blocks = len(ours["flags"]) - 1
        assert ours["flags"] == [(False, True)] * n_blocks + [(True, False)], ours["flags"]
        assert_close_lists(ours["losses"], theirs["losses"], rtol=1e-5, what=f"reshard_after_forward=None, rank {rank}")
        assert_state_close(ours["state"], theirs["state"], what=f"reshard_after_forward=None, rank {rank}", adam=True)
        theirs = r["cast"]["torch"]
        assert theirs["dtypes"] == [(torch.float64,) * 3] * 4, theirs["dtypes"]
        for name in ("ours", "ours_double"):
            ours = r["cast"][name]
            what = f"cast to float64 after fully_shard ({name}), rank {rank}"
            assert ours["dtypes"] == theirs["dtypes"], (what, ours["dtypes"])
            assert ours["grad_dtypes"] == theirs["grad_dtypes"], (what, ours["grad_dtypes"])
            assert_close_lists(ours["losses"], theirs["losses"], rtol=FP64["rtol"], what=what)
            assert_state_close(ours["state"], theirs["state"], what=what, **FP64)
        assert r["ddp_unused_refused"] == {"torch": "RuntimeError True", "ours": "RuntimeError True"}, \
            r["ddp_unused_refused"]
        pickled = r["pickled"]
        assert pickled["kind"] == "DistributedDataParallel"
        assert_state_close(pickled["state"], pickled["expected"], what=f"pickled DDP, rank {rank}", rtol=0, atol=0)
        # the step averaged over the ranks: both ranks hold the same weights
        assert_state_close(pickled["state"], results[0]["pickled"]["state"], what="pickled DDP", rtol=0, atol=0)


def _two_d_gpt() -> dict:
    """torchtitan's composition on shardwise: a (dp, tp) DeviceMesh, the GPT's own TP plan on mesh["tp"],
    fully_shard over mesh["dp"], torch's clip_grad_norm_ on model.parameters()."""
    import shardwise
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tiny_gpt(seq_len=SEQ)
    shardwise.parallelize_module(model, mesh["tp"])
    for block in model.blocks:
        shardwise.fully_shard(block, mesh=mesh["dp"])
    shardwise.fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for b in global_batches():
        (rows,) = shard_global_batch(b, dp_size=2, dp_rank=mesh["dp"].get_local_rank(), grad_accum=1)
        loss = model(*lm_pair(rows))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).full_tensor()))
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(float(loss.detach())))
    # the whole model from the DTensors alone: each a (dp, tp) placement of the full parameter
    return {"losses": losses, "norms": norms, "state": {k: v.full_tensor() for k, v in model.state_dict().items()}}


def _gpt_reference() -> dict:
    model = tiny_gpt(seq_len=SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for b in global_batches():
        loss = model(*lm_pair(b))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "state": {k: v.detach() for k, v in model.state_dict().items()}}


class _FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


def _two_d_torch_plan(which: str) -> dict:
    """One plan in torch's styles, applied by torch's parallelize_module + FSDP2, or by shardwise's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(11)
    model = nn.Sequential(*[_FeedForward(8) for _ in range(2)])
    plan = {"*.w1": ColwiseParallel(), "*.w2": RowwiseParallel()}
    if which.startswith("torch"):      # torch's parallelize_module (then FSDP2's, or shardwise's fully_shard)
        from torch.distributed.tensor.parallel import parallelize_module
        plan = {f"{i}.{name}": style for i in range(2) for name, style in (("w1", ColwiseParallel()),
                                                                          ("w2", RowwiseParallel()))}
        parallelize_module(model, mesh["tp"], plan)
    else:
        import shardwise
        shardwise.parallelize_module(model, mesh["tp"], plan)
    if which == "torch_tp_checkpointed":     # backward runs each block's forward again, on a gather in backward
        from torch.utils.checkpoint import checkpoint
        for ff in model:
            ff.forward = functools.partial(checkpoint, ff.forward, use_reentrant=False)
    fully_shard = _fully_shard_fn("torch" if which == "torch" else "ours")
    for ff in model:
        fully_shard(ff, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=WEIGHT_DECAY)
    x = torch.randn(4, 2, 6, 8, generator=torch.Generator().manual_seed(12))[:, mesh["dp"].get_local_rank()]
    losses, norms, method_norms = [], [], []
    for step in range(4):
        loss = model(x[step]).square().mean()
        loss.backward()
        if which != "torch":        # FSDPModule's own method, not clipping here: the same norm
            method_norms.append(float(model.clip_grad_norm_(float("inf"))))
        norms.append(_clip_2d(model, 0.5) if which == "torch" else
                     float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).full_tensor()))
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(float(loss.detach())))
    placements = {n: (str(p.placements), tuple(p.shape), tuple(p.to_local().shape))
                  for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return {"losses": losses, "norms": norms, "method_norms": method_norms, "placements": placements,
            "state": {k: v.full_tensor() for k, v in model.state_dict().items()}}


def _clip_2d(model: nn.Module, max_norm: float) -> float:
    """torch's clip_grad_norm_ rule for torch's own TP + FSDP2, whose parameters outside the plan live on the dp
    mesh only, the others on the (dp, tp) mesh: torch's function refuses to mix them (torchtitan clips per mesh)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(sum(g.full_tensor().double().pow(2).sum() for g in grads) ** 0.5)
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return norm


def _reshard_int(which: str) -> dict:
    """FSDP2's int `reshard_after_forward` (the group size to reshard to after forward), at 4 ranks: 2 (a smaller
    group: the parameters are DTensors again after forward, the root's own too) and 1 (kept gathered: plain
    tensors), and True given explicitly (the root's parameters freed after forward too). FSDP2's losses and
    parameters."""
    from torch.distributed.tensor import DTensor
    fully_shard = _fully_shard_fn(which)
    out: dict = {}
    for size in (2, 1, True):           # (keyed by name below: True == 1 as a dict key)
        torch.manual_seed(42)
        model = nn.Sequential(_MLP(8), _MLP(8), nn.Linear(8, 8))       # the root holds the last Linear
        for mlp in model[:2]:
            fully_shard(mlp, reshard_after_forward=size)
        fully_shard(model, reshard_after_forward=size)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + dist.get_rank())
        x = torch.randn(4, 8)
        losses, after_forward = [], []
        for _ in range(3):
            loss = model(x).sum()
            after_forward.append([isinstance(p, DTensor) for p in model.parameters()])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(float(loss.detach())))
        out[repr(size)] = {"after_forward": after_forward, "losses": losses,
                     "state": {k: v.full_tensor() for k, v in model.state_dict().items()}}
    return out


def _four_ranks() -> dict:
    torch.set_num_threads(1)
    return {"clip": {which: _clip_with_torch(which) for which in ("torch", "ours")}, "gpt_2d": _two_d_gpt(),
            "reshard_int": {which: _reshard_int(which) for which in ("torch", "ours")},
            "plan_2d": {which: _two_d_torch_plan(which)
                        for which in ("torch", "ours", "torch_tp", "torch_tp_checkpointed")}}


def test_torch_view_four_ranks():
    results = run_distributed(_four_ranks, 4, timeout=300)
    _check_clip(results, 4)
    ref = _gpt_reference()
    for rank, r in enumerate(results):
        what = f"(dp, tp) = (2, 2) GPT, rank {rank}"
        ours = r["gpt_2d"]
        assert_close_lists(ours["norms"], ref["norms"], rtol=1e-5, what=f"{what}: norms")
        assert_close_lists(ours["losses"], ref["losses"], rtol=1e-5, what=f"{what}: losses")
        assert_state_close(ours["state"], ref["state"], what=what, adam=True)
        for size, freed in (("2", True), ("1", False), ("True", True)):
            ours, theirs = r["reshard_int"]["ours"][size], r["reshard_int"]["torch"][size]
            what = f"reshard_after_forward={size} at 4 ranks, rank {rank}"
            assert theirs["after_forward"] == [[freed] * 10] * 3, (what, theirs["after_forward"])
            assert ours["after_forward"] == theirs["after_forward"], (what, ours["after_forward"])
            assert_close_lists(ours["losses"], theirs["losses"], rtol=1e-5, what=what)
            assert_state_close(ours["state"], theirs["state"], what=what, adam=True)
        theirs = r["plan_2d"]["torch"]
        for name in ("ours", "torch_tp", "torch_tp_checkpointed"):
            _check_plan_2d(r["plan_2d"][name], theirs, what=f"(dp, tp) = (2, 2), torch's plan, {name}, rank {rank}")


def _check_plan_2d(ours: dict, theirs: dict, *, what: str) -> None:
    """Against torch's own TP + FSDP2: FSDP2 + TP's placements (_StridedShard over dp for dim-0 TP slices), global
    and local shapes; the parameters outside the plan are on the (dp, tp) mesh too (Replicate over tp), where torch
    leaves them on the dp mesh, which its own clip_grad_norm_ then refuses to mix with the others."""
    assert ours["placements"].keys() == theirs["placements"].keys(), what
    for name, (placements, *shapes) in theirs["placements"].items():
        if "w1" in name or "w2" in name:
            assert ours["placements"][name] == (placements, *shapes), (what, name, ours["placements"][name])
        else:
            assert placements == "(Shard(dim=0),)", (what, name, placements)
            assert ours["placements"][name] == ("(Shard(dim=0), Replicate())", *shapes), (what, name)
    assert_close_lists(ours["norms"], theirs["norms"], rtol=1e-5, what=f"{what}: norms")
    assert_close_lists(ours["method_norms"], theirs["norms"], rtol=1e-5, what=f"{what}: clip_grad_norm_ method")
    assert_close_lists(ours["losses"], theirs["losses"], rtol=1e-5, what=f"{what}: losses")
    assert_state_close(ours["state"], theirs["state"], what=what)
