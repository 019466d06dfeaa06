"""`torch.distributed.checkpoint` on `fully_shard`'s sharded state dicts (DTensors, as FSDP2's), in one 4-rank
launch: ranks 0 and 1 train 3 AdamW steps and save with DCP, then go on for 3 more. Ours and torch FSDP2 each do
this. Then 4 ranks load each checkpoint (DCP reshards 2 -> 4) into a fresh model with other weights: ours from
ours, ours from FSDP2's, FSDP2 from ours. The 3 steps after must equal the 2-rank run that went on (fp32,
rtol 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from wrapper_state_cases import ADAMW, SEQ, _sharded, batches, train
from shardwise.testing import assert_close_lists, assert_state_close, run_distributed, tiny_gpt


def _fsdp2(seed: int, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(group, "cpu")
    model = tiny_gpt(seq_len=SEQ, seed=seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(model) -> dict:
    if hasattr(model, "full_state_dict"):
        return model.full_state_dict()
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _worker(path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import shardwise
    pair = dist.new_group([0, 1])
    world = dist.group.WORLD
    out: dict = {}
    if dist.get_rank() < 2:
        for name, build, get in (("ours", _sharded, shardwise.get_state_dict), ("fsdp2", _fsdp2, get_state_dict)):
            model = build(1234, pair)
            opt = torch.optim.AdamW(model.parameters(), **ADAMW)
            train(model, opt, batches()[:3], pair)
            msd, osd = get(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/{name}", process_group=pair)
            out[name] = {"losses": train(model, opt, batches()[3:], pair), "state": _full(model)}
    dist.barrier()
    for name, build, src, get, put in (
            ("ours<-ours", _sharded, "ours", shardwise.get_state_dict, shardwise.set_state_dict),
            ("ours<-fsdp2", _sharded, "fsdp2", shardwise.get_state_dict, shardwise.set_state_dict),
            ("fsdp2<-ours", _fsdp2, "ours", get_state_dict, set_state_dict)):
        model = build(77, world)                   # other weights: only the loaded state may count
        opt = torch.optim.AdamW(model.parameters(), lr=1.0)      # the loaded param_groups set lr
        msd, osd = get(model, opt)                 # templates: a fresh optimizer's state is initialized
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=f"{path}/{src}")
        put(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out[name] = {"losses": train(model, opt, batches()[3:], world), "state": _full(model),
                     "lr": opt.param_groups[0]["lr"]}
    return out


@pytest.mark.timeout(300)
def test_dcp_checkpoints_reshard_and_cross_with_fsdp2(tmp_path) -> None:
    results = run_distributed(_worker, 4, args=(str(tmp_path),), timeout=240)
    for src in ("ours", "fsdp2"):
        reference = results[0][src]
        for rank, r in enumerate(results):
            for name in (n for n in ("ours<-ours", "ours<-fsdp2", "fsdp2<-ours") if n.endswith(src)):
                what = f"{name} at 4 ranks (rank {rank}) vs {src} at 2 ranks uninterrupted"
                assert r[name]["lr"] == ADAMW["lr"], what
                assert_close_lists(r[name]["losses"], reference["losses"], rtol=1e-5, what=what)
                assert_state_close(r[name]["state"], reference["state"], what=what, adam=True)
