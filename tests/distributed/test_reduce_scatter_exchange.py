"""`Comm.reduce_scatter_sum` (pairwise exchange on gloo) against gloo's `dist.reduce_scatter_tensor`.

Integer-valued floats and integers sum exactly in any order, so those cases must match gloo bit for bit; random
floats must match within one rounding per addend. Several exchanges in flight at once (distinct tags, completed
out of launch order) must not mix their messages. The ledger records one "reduce_scatter" of the input's bytes,
as `reduce_scatter_tensor` does. Ranks collect failures and return them (raising would leave peers blocked).
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from shardwise.comm import Comm, CommLedger
from shardwise.testing import run_distributed

# (elements per rank's chunk, dtype, integer-valued)
CASES = [(1, torch.float32, True), (1000, torch.float32, True), (4097, torch.float32, False),
         (300, torch.bfloat16, True), (513, torch.int64, True), (0, torch.float32, True)]


def _input(rank: int, size: int, shard: int, dtype: torch.dtype, integer: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 97 + rank)
    if integer:
        return torch.randint(-50, 50, (size * shard,), generator=g).to(dtype)
    return torch.randn(size * shard, generator=g).to(dtype)


def _check_all() -> list[str]:
    rank, size = dist.get_rank(), dist.get_world_size()
    ledger = CommLedger()
    comm = Comm(None, ledger, name="dp")
    failures: list[str] = []
    try:
        for seed, (shard, dtype, integer) in enumerate(CASES):
            full = _input(rank, size, shard, dtype, integer, seed)
            ours = torch.full((shard,), -7, dtype=dtype)
            comm.reduce_scatter_sum(ours, full, tag=seed)
            theirs = torch.empty(shard, dtype=dtype)
            dist.reduce_scatter_tensor(theirs, full.clone())
            tol = {} if integer else {"rtol": 1e-6 * size, "atol": 1e-6 * size}
            try:
                torch.testing.assert_close(ours, theirs, rtol=tol.get("rtol", 0), atol=tol.get("atol", 0))
            except AssertionError as e:
                failures.append(f"rank {rank} shard {shard} {dtype}: {e}")
        # three exchanges in flight, waited newest first; inputs left intact
        fulls = [_input(rank, size, 64, torch.float32, True, 100 + k) for k in range(3)]
        kept = [f.clone() for f in fulls]
        outs = [torch.empty(64) for _ in fulls]
        handles = [comm.reduce_scatter_sum(o, f, tag=k, async_op=True) for k, (o, f) in enumerate(zip(outs, fulls))]
        for h in reversed(handles):
            h.wait()
        for k, (o, f) in enumerate(zip(outs, fulls)):
            expected = torch.empty(64)
            dist.reduce_scatter_tensor(expected, f.clone())
            if not torch.equal(o, expected):
                failures.append(f"rank {rank} concurrent exchange {k}: wrong result")
            if not torch.equal(f, kept[k]):
                failures.append(f"rank {rank} concurrent exchange {k}: input modified")
        ledger.begin_step(1)
        comm.reduce_scatter_sum(torch.empty(10), torch.ones(10 * size), tag=0)
        recorded = [(s.op, s.nbytes, s.count) for s in ledger.summary(1)]
        if recorded != [("reduce_scatter", 40 * size, 1)]:
            failures.append(f"rank {rank} ledger: {recorded}")
    except Exception:       # noqa: BLE001 - reported to the test, not raised into the peers' collectives
        failures.append(traceback.format_exc())
    return failures


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_exchange_matches_gloo_reduce_scatter(world_size: int) -> None:
    for failures in run_distributed(_check_all, world_size):
        assert failures == []


def test_shape_mismatch_is_refused() -> None:
    from shardwise.comm.exchange import PairwiseReduceScatter
    with pytest.raises(ValueError, match="4 x 3 elements"):
        PairwiseReduceScatter(torch.empty(3), torch.empty(10), group=None, rank=0, size=4, tag=0,
                              to_global=lambda r: r)
