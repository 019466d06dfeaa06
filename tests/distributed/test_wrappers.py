"""The module wrappers with the seed's plain loop (`optimizer.zero_grad(); loss = model(**batch); loss.backward();
optimizer.step()`) equal a single-process run and torch's own DDP / FSDP2 on the same model and data.

One launch per world size runs every case on the same ranks: fp32 at rtol 1e-5 (AdamW with clipping and
gradient accumulation through set_requires_gradient_sync / no_sync, SGD with momentum), bf16 parameters with
fp32 reduction against FSDP2 with the same policy, and at 4 ranks tensor parallelism x fully_shard on a 2 x 2
mesh against the single process. At 2 and 4 ranks each rank's parameters after training are FSDP2's local
shards (`p.to_local()`: the same dim-0 rows, shapes and values), and nanoGPT's optimizer grouping (weight decay
on parameters of 2 or more dimensions) trains as on one process. Saving and resuming (model and optimizer state
dicts, at 2 ranks resumed at 4 and at 1) and the communication reports run in the same launches
(wrapper_state_cases.py), and so do the cases on small modules: refusals, casts, odd shapes
(wrapper_small_cases.py)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

import wrapper_small_cases
import wrapper_state_cases
from test_dp_parity import SEQ, global_batches
from wrapper_small_cases import ADAMW, NANOGPT, SGD
from wrapper_small_cases import optimizer as _optimizer
from shardwise.testing import (
    assert_close_growing, assert_close_lists, assert_state_close, lm_pair, mean_over_ranks, micro_steps,
    reference_train, run_distributed, shard_global_batch, state_copy, tiny_gpt,
)

CASES = {          # name: (optimizer, gradient accumulation, clip)
    "adamw_accum_clip": (ADAMW, 2, 0.5),
    "sgd": (SGD, 1, None),
    "nanogpt_groups": (NANOGPT, 1, None),
}
BF16_EPS = 2.0 ** -7        # bf16's machine epsilon


def _local(model) -> dict:
    """Each parameter as this rank holds it while its unit is free (FSDP2: the DTensor's local shard)."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}


def reference(case: str) -> tuple[list[float], dict]:
    spec, gas, clip = CASES[case]
    model = tiny_gpt(seq_len=SEQ)
    losses = reference_train(model, _optimizer(spec, model.parameters()),
                             micro_steps(global_batches(), grad_accum=gas), loss_fn=lambda m, mb: m(*mb), clip=clip)
    return losses, state_copy(model)


def seed_loop(model, optimizer, *, gas: int, dp: int, dp_rank: int, clip=None, no_sync=None) -> list[float]:
    """The seed's loop over this rank's micro-batches: the last micro-batch of a step synchronises."""
    losses = []
    for b in global_batches():
        optimizer.zero_grad()
        total = 0.0
        for k, rows in enumerate(shard_global_batch(b, dp_size=dp, dp_rank=dp_rank, grad_accum=gas)):
            ids, labels = lm_pair(rows)
            batch = {"input_ids": ids, "labels": labels}
            with no_sync() if no_sync is not None and k < gas - 1 else contextlib.nullcontext():
                loss = model(**batch)
                (loss / gas).backward()
            total += float(loss.detach())
        if clip is not None:
            clip()
        optimizer.step()
        losses.append(mean_over_ranks(total / gas))
    return losses


def _checkpointed(model: torch.nn.Module, reentrant: bool | None) -> torch.nn.Module:
    """Each block's forward under torch's activation checkpointing (as torchtitan applies it before fully_shard):
    backward re-runs the block's forward, which must gather its unit again."""
    from torch.utils.checkpoint import checkpoint
    if reentrant is not None:
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=reentrant)
    return model


def _ours_fully_shard(case: str, mp=None, *, reentrant: bool | None = None) -> dict:
    import shardwise
    spec, gas, clip = CASES[case]
    model = _checkpointed(tiny_gpt(seq_len=SEQ), reentrant)
    policy = mp or shardwise.MixedPrecisionPolicy()
    for block in model.blocks:
        shardwise.fully_shard(block, mp_policy=policy)
    shardwise.fully_shard(model, mp_policy=policy)
    opt = _optimizer(spec, model.parameters())
    world, rank = dist.get_world_size(), dist.get_rank()
    losses = seed_loop(model, opt, gas=gas, dp=world, dp_rank=rank,
                       clip=(lambda: model.clip_grad_norm_(clip)) if clip else None,
                       no_sync=wrapper_state_cases.grad_sync_off(model))
    return {"losses": losses, "state": model.full_state_dict(),
            "sharded": wrapper_state_cases.portable(model.sharded_state_dict()),
            "numel": sum(v.numel() for v in _local(model).values()), "local": _local(model),
            "decayed": len(opt.param_groups[0]["params"])}


def _ours_fsdp1(case: str) -> dict:
    import shardwise
    spec, gas, clip = CASES[case]
    from shardwise.models.gpt import MLP, Attention, Block
    # SGD: nested units (attention and MLP inside each block's unit), as torch's class-set policies give
    policy = {Attention, MLP, Block} if case == "sgd" else None
    model = shardwise.FullyShardedDataParallel(tiny_gpt(seq_len=SEQ), mixed_precision=shardwise.MixedPrecision(),
                                               auto_wrap_policy=policy)
    opt = _optimizer(spec, model.parameters())
    losses = seed_loop(model, opt, gas=gas, dp=dist.get_world_size(), dp_rank=dist.get_rank(),
                       clip=(lambda: model.clip_grad_norm_(clip)) if clip else None, no_sync=model.no_sync)
    return {"losses": losses, "state": model.full_state_dict()}


def _ours_ddp(case: str, all_reduce: str, *, reentrant: bool | None = None) -> dict:
    import shardwise
    spec, gas, clip = CASES[case]
    # a different seed on ranks > 0: the wrapper must start every rank from rank 0's weights
    net = _checkpointed(tiny_gpt(seq_len=SEQ, seed=1234 + 7 * dist.get_rank()), reentrant)
    model = shardwise.DistributedDataParallel(net, bucket_cap_mb=0.01, all_reduce=all_reduce)
    opt = _optimizer(spec, model.parameters())
    losses = seed_loop(model, opt, gas=gas, dp=dist.get_world_size(), dp_rank=dist.get_rank(),
                       clip=(lambda: model.clip_grad_norm_(clip)) if clip else None, no_sync=model.no_sync)
    return {"losses": losses, "state": state_copy(model.module), "buckets": len(model.reducer.buckets),
            "impl": model.reducer.impl.value}


def _torch_ddp(case: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP
    spec, gas, clip = CASES[case]
    model = DDP(tiny_gpt(seq_len=SEQ), bucket_cap_mb=0.01)
    opt = _optimizer(spec, model.parameters())
    losses = seed_loop(model, opt, gas=gas, dp=dist.get_world_size(), dp_rank=dist.get_rank(),
                       clip=(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) if clip else None,
                       no_sync=model.no_sync)
    return {"losses": losses, "state": state_copy(model.module)}


def _torch_fsdp2(case: str, mp=None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    spec, gas, clip = CASES[case]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_gpt(seq_len=SEQ)
    kw = {"mp_policy": mp} if mp is not None else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    opt = _optimizer(spec, model.parameters())
    losses = seed_loop(model, opt, gas=gas, dp=dist.get_world_size(), dp_rank=dist.get_rank(),
                       clip=(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) if clip else None,
                       no_sync=wrapper_state_cases.grad_sync_off(model))
    return {"losses": losses, "state": {k: v.full_tensor() for k, v in model.state_dict().items()},
            "local": _local(model), "decayed": len(opt.param_groups[0]["params"]),
            "sharded": wrapper_state_cases.portable(model.state_dict())}


def _bf16_pair() -> dict:
    """bf16 parameters, fp32 reduction: ours and FSDP2 with the same policy, AdamW, accumulation, clipping."""
    import shardwise
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    ours = _ours_fully_shard("adamw_accum_clip", shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                                 reduce_dtype=torch.float32))
    theirs = _torch_fsdp2("adamw_accum_clip", TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    return {"ours": ours, "fsdp2": theirs}


def _state_dict_round_trip() -> dict:
    """full_state_dict -> a fresh wrapped model; the sharded state dict -> load_state_dict."""
    import shardwise
    model = tiny_gpt(seq_len=SEQ, seed=5)
    shardwise.fully_shard(model.blocks[0])
    shardwise.fully_shard(model)
    full = model.full_state_dict()
    other = tiny_gpt(seq_len=SEQ, seed=6)
    shardwise.FullyShardedDataParallel(other)
    other.load_full_state_dict(full)
    again = other.full_state_dict()
    third = tiny_gpt(seq_len=SEQ, seed=7)
    shardwise.fully_shard(third.blocks[0])
    shardwise.fully_shard(third)
    third.load_state_dict(model.sharded_state_dict())
    return {"full": full, "again": again, "third": third.full_state_dict(), "unwrapped": state_copy(tiny_gpt(
        seq_len=SEQ, seed=5))}


def _two_ranks() -> dict:
    torch.set_num_threads(1)
    out = {"state_dicts": _state_dict_round_trip(), **wrapper_small_cases.two_ranks()}
    for case in ("adamw_accum_clip", "sgd"):
        out[case] = {"fully_shard": _ours_fully_shard(case), "fsdp1": _ours_fsdp1(case),
                     "ddp": _ours_ddp(case, "auto"), "ddp_gloo": _ours_ddp(case, "backend"),
                     "ddp_ring": _ours_ddp(case, "ring"),
                     "torch_ddp": _torch_ddp(case), "torch_fsdp2": _torch_fsdp2(case)}
    out["nanogpt_groups"] = {"fully_shard": _ours_fully_shard("nanogpt_groups"),
                             "torch_fsdp2": _torch_fsdp2("nanogpt_groups")}
    out["bf16"] = _bf16_pair()
    out["saving"] = wrapper_state_cases.two_ranks()
    case = "adamw_accum_clip"
    out["checkpointed"] = {"fully_shard": _ours_fully_shard(case, reentrant=False),
                           "ddp_reentrant": _ours_ddp(case, "backend", reentrant=True)}
    return out


def _check_local_rows(ours: dict, sharded: dict, fsdp2: dict, fsdp2_sharded: dict, *, what: str) -> None:
    """Our resting parameters and sharded state dict are FSDP2's local shards: the same dim-0 rows (shapes) and
    values; the state dict's entries are DTensors of FSDP2's global shapes and placements."""
    assert ours.keys() == fsdp2.keys(), f"{what}: names {sorted(ours.keys() ^ fsdp2.keys())} differ"
    for k, v in fsdp2.items():
        assert ours[k].shape == v.shape, f"{what} {k}: local shape {tuple(ours[k].shape)}, FSDP2's {tuple(v.shape)}"
        kind, local, shape, placements = sharded[k]
        assert (kind, shape, placements) == ("DTensor", *fsdp2_sharded[k][2:]), (what, k, sharded[k][2:])
        assert torch.equal(local, ours[k]), f"{what} {k}: the sharded state dict is not the local rows"
        if not k.endswith("k_proj.bias"):           # Adam on an exactly-zero gradient: see assert_state_close
            torch.testing.assert_close(ours[k], v, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{what} {k}: {m}")


def _check_fp32(results: list[dict], world: int) -> None:
    for case in CASES:
        if case not in results[0]:
            continue
        ref_losses, ref_state = reference(case)
        adam = CASES[case][0] is not SGD
        for rank, r in enumerate(results):
            runs = r[case]
            if "torch_fsdp2" in runs:
                mine = runs["fully_shard"]
                _check_local_rows(mine["local"], mine["sharded"], runs["torch_fsdp2"]["local"],
                                  runs["torch_fsdp2"]["sharded"], what=f"{world} ranks, {case}, rank {rank}")
            for name, run in runs.items():
                what = f"{world} ranks, {case}, {name}, rank {rank}"
                assert_close_lists(run["losses"], ref_losses, rtol=1e-5, what=what)
                assert_state_close(run["state"], ref_state, what=what, adam=adam)
            for ours, peer in (("fully_shard", "torch_fsdp2"), ("fsdp1", "torch_fsdp2"), ("ddp", "torch_ddp"),
                               ("ddp_gloo", "torch_ddp")):
                if peer in runs and ours in runs:
                    assert_close_lists(runs[ours]["losses"], runs[peer]["losses"], rtol=1e-5,
                                       what=f"{case} {ours} vs {peer}")
                    assert_state_close(runs[ours]["state"], runs[peer]["state"], what=f"{case} {ours} vs {peer}",
                                       adam=adam)


def test_wrappers_two_ranks_equal_single_process_and_torch():
    results = run_distributed(_two_ranks, 2, timeout=400)
    _check_fp32(results, 2)
    wrapper_state_cases.check_two_ranks([r["saving"] for r in results])
    # activation checkpointing inside the wrapped blocks trains as without it
    ref_losses, ref_state = reference("adamw_accum_clip")
    for rank, r in enumerate(results):
        for name, run in r["checkpointed"].items():
            what = f"checkpointed blocks, {name}, rank {rank}"
            assert_close_lists(run["losses"], ref_losses, rtol=1e-5, what=what)
            assert_state_close(run["state"], ref_state, what=what, adam=True)
    r0 = results[0]
    # nanoGPT's grouping sees the parameters' true dimensions: the same decayed set as on one process
    matrices = sum(p.dim() >= 2 for p in tiny_gpt(seq_len=SEQ).parameters())
    assert r0["nanogpt_groups"]["fully_shard"]["decayed"] == r0["nanogpt_groups"]["torch_fsdp2"]["decayed"] == \
        matrices > 0
    total = sum(v.numel() for v in r0["adamw_accum_clip"]["fully_shard"]["state"].values())
    # every rank holds about half the parameters (padding aside), and several DDP buckets were used
    assert r0["adamw_accum_clip"]["fully_shard"]["numel"] < 0.6 * total
    assert r0["sgd"]["ddp"]["buckets"] > 3
    # the DDP wrapper's default on this host sums through shared memory; "backend" through gloo
    assert (r0["sgd"]["ddp"]["impl"], r0["sgd"]["ddp_gloo"]["impl"]) == ("shm", "backend")
    wrapper_small_cases.check(results)
    sd = r0["state_dicts"]
    for name in ("full", "again", "third"):
        assert_state_close(sd[name], sd["unwrapped"], what=f"state dict {name}", rtol=0, atol=0)
    # bf16 compute, fp32 reduce: the first step's loss is bitwise FSDP2's, later ones within n * eps / 64
    for rank, r in enumerate(results):
        ours, theirs = r["bf16"]["ours"], r["bf16"]["fsdp2"]
        assert_close_growing(ours["losses"], theirs["losses"], rtol_per_step=BF16_EPS / 64,
                             steps=list(range(len(theirs["losses"]))), what=f"bf16 losses rank {rank}")
        for k, v in theirs["state"].items():
            # fp32 masters after n AdamW steps of lr 3e-3: within one bf16 ulp of the weights' scale
            torch.testing.assert_close(ours["state"][k], v, rtol=BF16_EPS, atol=BF16_EPS * 3e-3 * 5,
                                       msg=lambda m, k=k: f"bf16 {k}: {m}")


def _tp_fully_shard() -> dict:
    """Tensor parallelism first (our GPT plan over the mesh's tp axis), then fully_shard over its dp axis."""
    import shardwise
    from shardwise.comm.ledger import CommLedger
    from shardwise.parallel.tensor_parallel import gather_full_state_dict
    from shardwise.models.parallelize import parallelize_gpt
    from shardwise.comm.topology import Axis, MeshShape, ParallelMesh
    spec, gas, clip = CASES["adamw_accum_clip"]
    mesh = ParallelMesh.build(MeshShape(dp=2, tp=2))
    tp_comm = mesh.comm(Axis.TP, CommLedger())
    model = tiny_gpt(seq_len=SEQ)
    parallelize_gpt(model, tp_comm)
    for block in model.blocks:
        shardwise.fully_shard(block, mesh=mesh)
    shardwise.fully_shard(model, mesh=mesh)
    opt = _optimizer(spec, model.parameters())
    losses = seed_loop(model, opt, gas=gas, dp=2, dp_rank=mesh.rank(Axis.DP), clip=lambda: model.clip_grad_norm_(clip),
                       no_sync=wrapper_state_cases.grad_sync_off(model))
    return {"losses": losses, "state": gather_full_state_dict(model, tp_comm, model.full_state_dict())}


def _offload_kept() -> dict:
    """CPU offload of the shards (the optimizer steps on the host), blocks kept gathered from forward to backward."""
    import shardwise
    spec, gas, clip = CASES["adamw_accum_clip"]
    model = tiny_gpt(seq_len=SEQ)
    for block in model.blocks:
        shardwise.fully_shard(block, reshard_after_forward=False, offload_policy=shardwise.CPUOffloadPolicy())
    shardwise.fully_shard(model, offload_policy=shardwise.CPUOffloadPolicy())
    opt = _optimizer(spec, model.parameters())
    losses = seed_loop(model, opt, gas=gas, dp=dist.get_world_size(), dp_rank=dist.get_rank(),
                       clip=lambda: model.clip_grad_norm_(clip),
                       no_sync=wrapper_state_cases.grad_sync_off(model))
    return {"losses": losses, "state": model.full_state_dict()}


def _four_ranks() -> dict:
    torch.set_num_threads(1)
    case = "adamw_accum_clip"
    return {case: {"fully_shard": _ours_fully_shard(case), "fsdp1": _ours_fsdp1(case),
                   "ddp": _ours_ddp(case, "auto"), "tp_x_fully_shard": _tp_fully_shard(),
                   "offload_kept": _offload_kept(), "torch_fsdp2": _torch_fsdp2(case)},
            "resume": wrapper_state_cases.four_ranks()}


def test_wrappers_four_ranks_and_tensor_parallel_equal_single_process():
    results = run_distributed(_four_ranks, 4, timeout=400)
    wrapper_state_cases.check_four_ranks([r["resume"] for r in results])
    _check_fp32(results, 4)           # every run against one process, fully_shard's local rows against FSDP2's
