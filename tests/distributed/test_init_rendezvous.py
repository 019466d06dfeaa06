"""`init_distributed` with an explicit rendezvous, the way DeepSpeed's own test harness and tcp:// / file:// users
call it: `init_method`, `rank` and `world_size` given, no torchrun environment."""

from __future__ import annotations

import os

import pytest
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


def _dist_api(rank: int, world: int, init_method: str, out: str) -> None:
    """deepspeed.comm's functions beyond the basic four, each against torch.distributed's own answer."""
    import shardwise
    comm = shardwise.comm
    comm.init_distributed("gloo", init_method=init_method, rank=rank, world_size=world)
    facts: dict = {}
    x = torch.arange(4, dtype=torch.float32) + rank
    gathered = torch.empty(4 * world)
    comm.all_gather_into_tensor(gathered, x)
    facts["all_gather_into_tensor"] = gathered.tolist()
    out_rs = torch.empty(2)
    comm.reduce_scatter_fn(out_rs, torch.arange(2 * world, dtype=torch.float32) * (rank + 1))
    facts["reduce_scatter"] = out_rs.tolist()
    a2a = torch.empty(world)
    comm.all_to_all_single(a2a, torch.full((world,), float(rank)))
    facts["all_to_all_single"] = a2a.tolist()
    half = torch.ones(3, dtype=torch.bfloat16) * (rank + 1)
    comm.inference_all_reduce(half)
    facts["inference_all_reduce"] = (half.dtype, half.tolist())
    objects: list = [None] * world
    comm.all_gather_object(objects, {"rank": rank})
    facts["all_gather_object"] = objects
    facts["ranks_of_world"] = comm.get_all_ranks_from_group(comm.get_world_group())
    last = comm.new_group([world - 1])                     # every rank calls new_group, as torch requires
    facts["new_group"] = comm.get_all_ranks_from_group(last) if rank == world - 1 else None
    comm.barrier(prof=False, log_name="barrier")
    torch.save(facts, f"{out}.{rank}")
    comm.destroy_process_group()
    facts_after = comm.is_initialized()
    torch.save(facts_after, f"{out}.{rank}.after")


def test_deepspeed_comm_functions(tmp_path) -> None:
    world = 2
    out = str(tmp_path / "facts")
    mp.spawn(_dist_api, args=(world, f"file://{tmp_path / 'store'}", out), nprocs=world)
    for rank in range(world):
        facts = torch.load(f"{out}.{rank}")
        assert facts["all_gather_into_tensor"] == [0.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0]
        # rank r holds elements [2r, 2r+2) of sum_k (k+1) * arange(4) = 3 * arange(4)
        assert facts["reduce_scatter"] == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]
        assert facts["all_to_all_single"] == [0.0, 1.0]
        assert facts["inference_all_reduce"] == (torch.bfloat16, [3.0, 3.0, 3.0])
        assert facts["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert facts["ranks_of_world"] == [0, 1]
        assert facts["new_group"] == ([world - 1] if rank == world - 1 else None)
        assert torch.load(f"{out}.{rank}.after") is False


def test_dist_init_required_false_without_a_group_is_refused() -> None:
    import shardwise
    from shardwise.errors import UserError
    assert not dist.is_initialized()
    with pytest.raises(UserError, match="dist_init_required=False"):
        shardwise.init_distributed(dist_init_required=False)
    with pytest.raises(UserError, match="dist_init_required=False"):
        shardwise.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1},
                             dist_init_required=False)
