"""The dynamic loss scaler moves exactly as DeepSpeed's, for random overflow patterns."""

import os
import random

import pytest
import torch
import torch.distributed as dist

from shardwise.parallel.precision import DynamicLossScaler, LossScaleAtMinimum, grads_have_inf_or_nan


def _ours(**kw):
    return DynamicLossScaler(init_scale=2.0 ** kw["power"], scale_window=kw["window"], min_scale=kw["min_scale"],
                             hysteresis=kw["hysteresis"], consecutive_hysteresis=kw["consecutive"])


def test_scale_grows_after_window_and_halves_after_hysteresis():
    s = _ours(power=4, window=3, min_scale=1, hysteresis=2, consecutive=False)
    seq = []
    for overflow in [False, False, False, False, True, True, False, False, False, False]:
        s.update(overflow)
        seq.append(s.loss_scale)
    # clean iterations 0..3: doubles once stable interval hits 3 (at iteration 3)
    assert seq[:4] == [16, 16, 16, 32]
    # first overflow spends hysteresis, second halves
    assert seq[4:6] == [32, 16]
    assert seq[6:] == [16, 16, 16, 32]


def test_overflow_at_minimum_scale_is_a_clear_error():
    s = _ours(power=1, window=1000, min_scale=2, hysteresis=1, consecutive=False)
    with pytest.raises(LossScaleAtMinimum, match="min_loss_scale"):
        s.update(True)


def test_inf_nan_detection():
    assert not grads_have_inf_or_nan([torch.ones(3), torch.zeros(2)])
    assert grads_have_inf_or_nan([torch.ones(3), torch.tensor([float("inf")])])
    assert grads_have_inf_or_nan([torch.tensor([float("nan")])])
    assert not grads_have_inf_or_nan([])
    assert grads_have_inf_or_nan([torch.tensor([float("inf"), float("-inf")])])      # inf - inf is nan: still found
    assert not grads_have_inf_or_nan([torch.full((1000,), 3e38)])                    # large but finite: not flagged
    for dtype in (torch.bfloat16, torch.float16):
        assert grads_have_inf_or_nan([torch.ones(4, dtype=dtype), torch.tensor([float("nan")], dtype=dtype)])
        assert not grads_have_inf_or_nan([torch.full((8,), 60000.0, dtype=dtype)])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("consecutive", [False, True])
def test_matches_deepspeed_dynamic_loss_scaler(seed, consecutive):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    if not dist.is_initialized():   # DeepSpeed's scaler logs with its comm's get_rank()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import deepspeed.comm
    import deepspeed.ops
    # Its shared-memory all-reduce kernel (inference only) would otherwise be JIT-compiled here: ~20 s to minutes.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    rng = random.Random(seed)
    kw = dict(power=rng.randint(3, 12), window=rng.randint(1, 6), min_scale=rng.choice([1, 2]),
              hysteresis=rng.randint(1, 3), consecutive=consecutive)
    ours = _ours(**kw)
    ref = ds_scaler.DynamicLossScaler(init_scale=2.0 ** kw["power"], scale_window=kw["window"],
                                      min_scale=kw["min_scale"], delayed_shift=kw["hysteresis"],
                                      consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)
    ours.raise_error_at_min_scale = False
    for _ in range(300):
        overflow = rng.random() < 0.2
        ours.update(overflow)
        ref.update_scale(overflow)
        assert ours.loss_scale == ref.cur_scale
        assert ours.cur_hysteresis == ref.cur_hysteresis
