"""`init_distributed` with an explicit rendezvous, the way DeepSpeed's own test harness and tcp:// / file:// users
call it: `init_method`, `rank` and `world_size` given, no torchrun environment."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _join(rank: int, world: int, init_method: str, out: str) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(key, None)
    import shardwise
    shardwise.init_distributed(dist_backend="gloo", init_method=init_method, rank=rank, world_size=world)
    shardwise.init_distributed(dist_backend="gloo", init_method=init_method, rank=rank, world_size=world)  # idempotent
    total = torch.tensor([float(rank + 1)])
    shardwise.comm.all_reduce(total)
    torch.save({"rank": shardwise.comm.get_rank(), "world": shardwise.comm.get_world_size(), "sum": float(total)},
               f"{out}.{rank}")
    dist.destroy_process_group()


def test_explicit_rendezvous_joins_every_rank(tmp_path) -> None:
    world = 2
    out = str(tmp_path / "facts")
    mp.spawn(_join, args=(world, f"file://{tmp_path / 'store'}", out), nprocs=world)
    facts = [torch.load(f"{out}.{rank}") for rank in range(world)]
    assert facts == [{"rank": rank, "world": world, "sum": 3.0} for rank in range(world)]
