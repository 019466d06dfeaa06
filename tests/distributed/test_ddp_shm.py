"""shardwise's shared-memory all-reduce (`all_reduce="shm"`) under the DDP wrapper.

The seed's loop (AdamW, accumulation 2 with no_sync, clipping) equals the single process at 2 and 4 ranks (4: the
buckets' chunks are uneven and each is summed in its own order); at 2 ranks it is bitwise the wrapper over gloo's
all-reduce (a + b on both ranks). The shared files are gone once the buckets are mapped. Refusals are agreed:
every rank raises the same one line and none is left in a barrier, and nothing is left in the directory. The
default, all_reduce="auto", takes shared memory where the ranks share it and gloo's all-reduce where not."""

from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.distributed as dist

from test_dp_parity import SEQ
from test_wrappers import _ours_ddp, reference
from shardwise.testing import assert_close_lists, assert_state_close, run_distributed, tiny_gpt


def _refusal(setup) -> str:
    import shardwise
    try:
        setup()
    except shardwise.UserError as e:
        return str(e)
    return "no error"


def _full_on_rank_1(directory: str):
    def fallocate(fd, offset, size, real=os.posix_fallocate):
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, size)

    def setup():
        import shardwise
        os.posix_fallocate = fallocate
        try:
            shardwise.DistributedDataParallel(tiny_gpt(seq_len=SEQ), bucket_cap_mb=0.01, all_reduce="shm")
        finally:
            os.posix_fallocate = fallocate.__defaults__[0]
    return setup


def _worker(tmp: str) -> dict:
    import shardwise
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    rank = dist.get_rank()
    own = os.path.join(tmp, "shared")
    os.makedirs(own, exist_ok=True)
    os.environ["SHARDWISE_SHM_DIR"] = own
    out = {"shm": _ours_ddp("adamw_accum_clip", "shm"), "left": sorted(os.listdir(own))}
    if dist.get_world_size() == 2:
        out["backend"] = _ours_ddp("adamw_accum_clip", "backend")
        hooked = shardwise.DistributedDataParallel(tiny_gpt(seq_len=SEQ), bucket_cap_mb=0.01, all_reduce="shm")
        out["errors"] = [_refusal(lambda: hooked.register_comm_hook(None, default_hooks.allreduce_hook)),
                         _refusal(_full_on_rank_1(own))]
        # ranks that report two kernels (hosts) are refused before any file is made
        import shardwise.comm.shm as shm
        real_boot_id, shm._boot_id = shm._boot_id, lambda: f"host {rank}"
        try:
            out["errors"].append(_refusal(lambda: shardwise.DistributedDataParallel(
                tiny_gpt(seq_len=SEQ), bucket_cap_mb=0.01, all_reduce="shm")))
        finally:
            shm._boot_id = real_boot_id
        # the default, 'auto': shared memory here; a comm hook then replaces it
        auto = shardwise.DistributedDataParallel(tiny_gpt(seq_len=SEQ), bucket_cap_mb=0.01)
        out["auto"] = auto.reducer.impl.value
        auto.register_comm_hook(None, default_hooks.allreduce_hook)
        # each rank its own directory: they do not see each other's files
        os.environ["SHARDWISE_SHM_DIR"] = os.path.join(tmp, f"alone{rank}")
        os.makedirs(os.environ["SHARDWISE_SHM_DIR"])
        out["errors"].append(_refusal(lambda: shardwise.DistributedDataParallel(
            tiny_gpt(seq_len=SEQ), bucket_cap_mb=0.01, all_reduce="shm")))
        apart = shardwise.DistributedDataParallel(tiny_gpt(seq_len=SEQ), bucket_cap_mb=0.01)
        out["auto_apart"] = apart.reducer.impl.value
        out["left_after_refusals"] = sorted(os.listdir(own)) + sorted(os.listdir(os.environ["SHARDWISE_SHM_DIR"]))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_shm_all_reduce_equals_single_process(world_size: int, tmp_path) -> None:
    results = run_distributed(_worker, world_size, args=(str(tmp_path),))
    ref_losses, ref_state = reference("adamw_accum_clip")
    for rank, res in enumerate(results):
        got = res["shm"]
        assert got["buckets"] > 1
        assert_close_lists(got["losses"], ref_losses, rtol=1e-5, what=f"{world_size} ranks, rank {rank}")
        assert_state_close(got["state"], ref_state, what=f"{world_size} ranks, rank {rank}", adam=True)
        assert res["left"] == []
    for k, v in results[0]["shm"]["state"].items():       # replicas stay identical bit for bit
        for res in results[1:]:
            assert torch.equal(res["shm"]["state"][k], v), k
    if world_size == 2:
        r0, r1 = results
        assert r0["shm"]["losses"] == r0["backend"]["losses"]
        for k, v in r0["backend"]["state"].items():
            assert torch.equal(r0["shm"]["state"][k], v), k
        assert r0["errors"] == r1["errors"], "every rank raises the same line"
        hook, full, hosts, apart = r0["errors"]
        assert "run on 2 hosts" in hosts and "all_reduce = 'backend'" in hosts
        assert "register_comm_hook with all_reduce='shm'" in hook and "all_reduce='backend'" in hook
        assert "is full" in full and "--shm-size" in full and "bucket_cap_mb" in full
        assert "do not share" in apart and "SHARDWISE_SHM_DIR" in apart
        assert r0["left_after_refusals"] == [] and r1["left_after_refusals"] == []
        # 'auto' takes shared memory where the ranks share it, and gloo's all-reduce where they do not
        assert (r0["auto"], r0["auto_apart"]) == (r1["auto"], r1["auto_apart"]) == ("shm", "backend")
