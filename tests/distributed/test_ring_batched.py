"""The ring's device path (one `batch_isend_irecv([send right, recv left])` per step, safe on NCCL), run on gloo:
its results against gloo's all-reduce, and the exact shape of every batched exchange it posts: every rank makes
every step's call with both operations, also where its chunks are empty (fewer elements than ranks), as NCCL's
first batched call needs.

One launch of 3 ranks runs every case. Ranks collect failures and return them (a raise would block the others)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.comm.ring import batches_steps, ring_all_reduce
from shardwise.testing import run_distributed


def _check_batched(sizes: list[int]) -> list[str]:
    rank, size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    failures: list[str] = []
    batches: list[list[tuple[str, int, int]]] = []
    real = dist.batch_isend_irecv

    def spy(ops: list) -> list:
        batches.append([(op.op.__name__, op.peer, op.tensor.numel()) for op in ops])
        return real(ops)

    dist.batch_isend_irecv = spy
    try:
        for numel in sizes:
            for dtype in (torch.int64, torch.float32):
                gen = torch.Generator().manual_seed(1000 * rank + numel)
                x = torch.randint(-50, 50, (numel,), generator=gen).to(dtype)   # integer values: exact sums
                expect = x.clone()
                dist.all_reduce(expect)
                batches.clear()
                ring_all_reduce(x, batched=True)
                if not torch.equal(x, expect):
                    failures.append(f"rank {rank} numel {numel} {dtype}: differs from dist.all_reduce")
                steps = 2 * (size - 1) if numel else 0        # an empty tensor is a no-op on every rank alike
                if len(batches) != steps:
                    failures.append(f"rank {rank} numel {numel}: {len(batches)} batches, expected {steps}")
                for b in batches:
                    kinds = [(kind, peer) for kind, peer, _ in b]
                    if kinds != [("isend", right), ("irecv", left)]:
                        failures.append(f"rank {rank} numel {numel}: batch {b} is not [send right, recv left]")
    finally:
        dist.batch_isend_irecv = real
    return failures


def test_batched_ring_matches_all_reduce_with_one_exchange_per_step() -> None:
    results = run_distributed(_check_batched, world_size=3, args=([0, 1, 2, 3, 4, 5, 17, 1000],))
    assert results == [[], [], []]


def test_device_tensors_take_the_batched_ring() -> None:
    assert batches_steps(torch.empty(4, device="meta"))
    assert not batches_steps(torch.empty(4))
