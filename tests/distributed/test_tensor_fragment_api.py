"""DeepSpeed's tensor-fragment API (`shardwise.utils.safe_{get,set}_{full,local}_*`): one script run at 2 ranks with
shardwise (ZeRO stages 0-3) and with DeepSpeed (stages 1-3; its stage 0 in fp32 has no fp32 mapping and answers
None), on the same model, data and config.

The script, per stage: a forward and backward; the full gradients read; every gradient then set to a fixed value V
and read back; a step (so the update is Adam's from V, the same for both libraries); the fp32 parameters and Adam's
exp_avg / exp_avg_sq read; then fp32 parameters and both states set to fixed values and read back; a second
step; the fp32 parameters read (its gradient set as well). Local values (shardwise, every stage): after setting a whole value, the local
pieces of the ranks, in rank order, are that value's elements (stage 0: each rank holds it whole), and a local
write shows in the full value.

Tolerances: fp32 Adam on the same inputs; the gradients of the first backward are reduced in each library's order
(one rounding per rank added: rtol 1e-5, as the other fp32 parity tests); values set and read back are exact.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from test_deepspeed_parity import _import_deepspeed
from shardwise.testing import assert_state_close, run_distributed

WORLD = 2
# With 60-element buckets (filled from the last parameter back), "2.bias" and "2.weight" share one bucket of 52
# elements: rank 1's half holds none of "2.bias", the case where a rank sets a parameter it holds no piece of.
SHAPES = {"0.weight": (12, 6), "0.bias": (12,), "2.weight": (4, 12), "2.bias": (4,)}


def _config(stage: int) -> dict:
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "steps_per_print": 10_000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "reduce_bucket_size": 60}}


def _fixed(name: str, scale: float, offset: float = 0.0) -> torch.Tensor:
    """A value of the parameter's shape, the same on every rank, different per parameter."""
    shape = SHAPES[name]
    n = torch.Size(shape).numel()
    return (torch.linspace(-1.0, 1.0, n) * scale + offset + 0.01 * len(name)).view(shape)


def _backward(engine, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x, y = torch.randn(2, 6, generator=g), torch.randn(2, 4, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)


def _script(ds, stage: int, tmp: str) -> dict:
    u = ds.utils
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    named = dict(engine.module.named_parameters())
    out: dict = {}
    _backward(engine, 1)
    out["grads"] = {n: u.safe_get_full_grad(p).clone() for n, p in named.items()}
    for n, p in named.items():
        u.safe_set_full_grad(p, _fixed(n, 0.1))
    out["grads_set"] = {n: u.safe_get_full_grad(p).clone() for n, p in named.items()}
    engine.step()
    out["fp32_1"] = {n: u.safe_get_full_fp32_param(p) for n, p in named.items()}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = {n: u.safe_get_full_optimizer_state(p, key) for n, p in named.items()}
    for n, p in named.items():
        u.safe_set_full_fp32_param(p, _fixed(n, 0.5))
        u.safe_set_full_optimizer_state(p, _fixed(n, 0.01), "exp_avg")
        u.safe_set_full_optimizer_state(p, _fixed(n, 1e-3, offset=2e-3), "exp_avg_sq")
    out["set"] = {n: (u.safe_get_full_fp32_param(p), u.safe_get_full_optimizer_state(p, "exp_avg"),
                      u.safe_get_full_optimizer_state(p, "exp_avg_sq")) for n, p in named.items()}
    if stage in (1, 2):     # whole parameters: the model agrees with the value set, on every rank
        out["model_set"] = {n: p.detach().clone() for n, p in named.items()}
    _backward(engine, 2)
    for n, p in named.items():    # the update is Adam's from the values set alone, whatever the forward used
        u.safe_set_full_grad(p, _fixed(n, 0.2, offset=-0.05))
    engine.step()
    out["fp32_2"] = {n: u.safe_get_full_fp32_param(p) for n, p in named.items()}
    if stage in (1, 3):
        out["consolidated"] = _consolidated(engine, os.path.join(tmp, f"{ds.__name__}_{stage}"))
    if ds.__name__ == "shardwise":
        out["local"] = _local_checks(u, named)
    return out


def _consolidated(engine, save_dir: str) -> dict:
    """The checkpoint's fp32 weights through shardwise's zero_to_fp32 and through DeepSpeed's (rank 0)."""
    engine.save_checkpoint(save_dir)
    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    from deepspeed.utils import zero_to_fp32 as theirs
    from shardwise.utils import zero_to_fp32 as ours
    # DeepSpeed's reader memory-maps the optimizer files (torch.load(mmap=True)): its tensors would read the files
    # when this rank pickles its result, after the other stages ran. Copied here: what it read when asked.
    return {"ours": ours.get_fp32_state_dict_from_zero_checkpoint(save_dir),
            "theirs": {n: t.clone() for n, t in theirs.get_fp32_state_dict_from_zero_checkpoint(save_dir).items()}}


def _local_checks(u, named: dict) -> dict:
    """Per parameter: every rank's local fp32 / exp_avg pieces after a whole value is set, and the whole value
    after each rank adds (rank + 1) to its local pieces."""
    out = {}
    for n, p in named.items():
        u.safe_set_full_fp32_param(p, _fixed(n, 0.25))
        u.safe_set_full_optimizer_state(p, _fixed(n, 0.02), "exp_avg")
        local, state = u.safe_get_local_fp32_param(p), u.safe_get_local_optimizer_state(p, "exp_avg")
        pieces: list = [None] * WORLD
        dist.all_gather_object(pieces, (local, state))
        u.safe_set_local_fp32_param(p, local + float(dist.get_rank() + 1))
        out[n] = {"pieces": pieces, "full_after": u.safe_get_full_fp32_param(p)}
    return out


def _ranks(stages: tuple[int, ...], ds_stages: tuple[int, ...], tmp: str) -> dict:
    import shardwise
    deepspeed = _import_deepspeed()
    ours = {s: _script(shardwise, s, tmp) for s in stages}
    theirs = {s: _script(deepspeed, s, tmp) for s in ds_stages}
    return {"shardwise": ours, "deepspeed": theirs}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("fragments"))
    return run_distributed(_ranks, WORLD, args=((0, 1, 2, 3), (1, 2, 3), tmp), timeout=400)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_values_match_deepspeed(results: list[dict], stage: int) -> None:
    for rank, res in enumerate(results):
        ours, theirs = res["shardwise"][stage], res["deepspeed"][stage]
        what = f"stage {stage} rank {rank}"
        assert_state_close(ours["grads"], theirs["grads"], what=f"{what} first gradients")
        for key in ("fp32_1", "exp_avg", "exp_avg_sq", "fp32_2"):
            assert_state_close(ours[key], theirs[key], what=f"{what} {key}")


@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_value_set_reaches_the_whole_parameter(results: list[dict], stage: int) -> None:
    """fp32 ZeRO 1-2 step this rank's shard of the parameter itself: a whole value set must not leave the ranks'
    models holding different mixes of old and new elements."""
    for rank, res in enumerate(results):
        for n, v in res["shardwise"][stage]["model_set"].items():
            assert torch.equal(v, _fixed(n, 0.5)), (stage, rank, n)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_values_set_are_read_back(results: list[dict], stage: int) -> None:
    for rank, res in enumerate(results):
        ours = res["shardwise"][stage]
        for n in SHAPES:
            assert torch.equal(ours["grads_set"][n], _fixed(n, 0.1)), (stage, rank, n)
            fp32, m, v = ours["set"][n]
            assert torch.equal(fp32, _fixed(n, 0.5)) and torch.equal(m, _fixed(n, 0.01)), (stage, rank, n)
            assert torch.equal(v, _fixed(n, 1e-3, offset=2e-3)), (stage, rank, n)


def test_stage0_updates_match_stage1(results: list[dict]) -> None:
    """Stage 0 has no DeepSpeed counterpart here (None there): its values are stage 1's, the same update."""
    for res in results:
        s0, s1 = res["shardwise"][0], res["shardwise"][1]
        for key in ("grads", "fp32_1", "exp_avg", "exp_avg_sq", "fp32_2"):
            assert_state_close(s0[key], s1[key], what=f"stage 0 vs 1 {key}")


@pytest.mark.parametrize("stage", [1, 2])
def test_a_rank_may_hold_no_piece(results: list[dict], stage: int) -> None:
    """The layout the other checks run on: "2.bias" lies wholly on rank 0 (so rank 1's model took the value set
    without holding a piece of it: test_fp32_value_set_reaches_the_whole_parameter)."""
    pieces = results[0]["shardwise"][stage]["local"]["2.bias"]["pieces"]
    assert [lp.numel() for lp, _ in pieces] == [4, 0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_local_pieces_are_the_full_values_elements(results: list[dict], stage: int) -> None:
    for n in SHAPES:
        value, state = _fixed(n, 0.25).reshape(-1), _fixed(n, 0.02).reshape(-1)
        pieces = results[0]["shardwise"][stage]["local"][n]["pieces"]
        if stage == 0:
            assert all(torch.equal(lp, value) and torch.equal(ls, state) for lp, ls in pieces), n
            expected = value + 1         # every rank adds to its whole copy; rank 0's is read
            held = [value.numel()] * WORLD
        else:
            assert torch.equal(torch.cat([lp for lp, _ in pieces]), value), n
            assert torch.equal(torch.cat([ls for _, ls in pieces]), state), n
            held = [lp.numel() for lp, _ in pieces]
            expected = value + torch.cat([torch.full((k,), float(r + 1)) for r, k in enumerate(held)])
        full = results[0]["shardwise"][stage]["local"][n]["full_after"].reshape(-1)
        assert torch.equal(full, expected), (n, held)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("writer", ["shardwise", "deepspeed"])
def test_zero_to_fp32_reads_both_libraries_checkpoints(results: list[dict], stage: int, writer: str) -> None:
    """shardwise's zero_to_fp32 on a checkpoint either library wrote gives the fp32 masters the writer trained
    (exactly: they are copied, not computed), as DeepSpeed's own zero_to_fp32 reads them."""
    side = results[0][writer][stage]
    masters = side["fp32_2"]
    ours = side["consolidated"]["ours"]
    assert ours.keys() == masters.keys()
    for n, v in masters.items():
        assert ours[n].dtype == torch.float32 and torch.equal(ours[n], v), (writer, stage, n)
    theirs = side["consolidated"]["theirs"]
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[n], ours[n]) for n in ours)
