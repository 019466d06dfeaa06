"""What save_checkpoint refuses or leaves out, as DeepSpeed's does (2 gloo ranks, one launch):

- "checkpoint": {"tag_validation": ...}: ranks saving under different tags. "Fail" raises one UserError line on
  every rank and writes nothing; "Warn" (the default) warns and "Ignore" does not, both then save under world
  rank 0's tag (one directory every rank writes into).
- save_dir="" is refused in one line, before anything is written.
- exclude_frozen_parameters=True leaves the frozen parameters out of the model states (DeepSpeed's
  module_state_dict); a strict load then refuses in one line naming the fix, load_module_strict=False loads the
  rest and keeps the model's own frozen values. At ZeRO stages 0, 2 and 3.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from shardwise.testing import run_distributed, tiny_gpt, token_batches

SEQ, BATCH = 16, 8
FROZEN = "embed.pos.weight"


def _engine(stage: int, *, seed: int = 1, checkpoint: dict | None = None, freeze: bool = False):
    import shardwise
    model = tiny_gpt(seq_len=SEQ, seed=seed)
    if freeze:
        model.get_parameter(FROZEN).requires_grad_(False)
    config = {"train_batch_size": BATCH, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40}}
    if checkpoint is not None:
        config["checkpoint"] = checkpoint
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine) -> float:
    import torch.distributed as dist
    rows = token_batches(1, BATCH, SEQ + 1, seed=3)[0].view(2, BATCH // 2, SEQ + 1)[dist.get_rank()]
    loss = engine(rows[:, :-1], rows[:, 1:])
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _tags(root: str) -> dict:
    import torch.distributed as dist
    from shardwise.errors import UserError
    rank = dist.get_rank()
    out: dict = {}
    for mode in ("Fail", "Warn", "Ignore", None):
        engine = _engine(0, checkpoint=None if mode is None else {"tag_validation": mode})
        where = f"{root}/tags_{mode}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                engine.save_checkpoint(where, tag=f"step1_rank{rank}")
                error, assertion = None, False
            except UserError as e:
                error, assertion = str(e), isinstance(e, AssertionError)    # DeepSpeed's type there
        out[mode] = {"error": error, "assertion": assertion, "warned": [str(w.message) for w in caught if "different tags" in str(w.message)],
                     "dirs": sorted(p.name for p in Path(where).iterdir()) if os.path.isdir(where) else []}
        engine.close()
    engine = _engine(0)
    for name, save_dir in (("empty_dir", ""), ("none_dir", None)):
        try:
            engine.save_checkpoint(save_dir, tag="x")
            out[name] = None
        except UserError as e:
            out[name] = str(e) if isinstance(e, ValueError) else f"not a ValueError: {e}"   # as DeepSpeed
    engine.close()
    return out


def _frozen(root: str, stage: int) -> dict:
    from shardwise.errors import CheckpointError
    engine = _engine(stage, freeze=True)
    _step(engine)
    engine.save_checkpoint(f"{root}/frozen{stage}", tag="t", exclude_frozen_parameters=True)
    saved = engine.consolidated_state_dict()
    engine.close()
    out: dict = {}
    if saved is not None:
        out["saved"] = {k: v.detach().clone() for k, v in saved.items()}
    tag = Path(root, f"frozen{stage}", "t")
    module_files = sorted(tag.glob("*model_states.pt"))
    out["keys"] = [sorted(torch.load(f, weights_only=False)["module"]) for f in module_files]
    fresh = _engine(stage, seed=2, freeze=True)
    try:
        fresh.load_checkpoint(f"{root}/frozen{stage}", tag="t")
        out["strict"] = None
    except CheckpointError as e:
        out["strict"] = str(e)
    fresh.load_checkpoint(f"{root}/frozen{stage}", tag="t", load_module_strict=False)
    loaded = fresh.consolidated_state_dict()
    if loaded is not None:
        out["loaded"] = {k: v.detach().clone() for k, v in loaded.items()}
        out["built"] = tiny_gpt(seq_len=SEQ, seed=2).state_dict()[FROZEN]
    out["next"] = _step(fresh)
    fresh.close()
    return out


def _run(root: str) -> dict:
    torch.set_num_threads(1)
    return {"tags": _tags(root), **{f"frozen{s}": _frozen(root, s) for s in (0, 2, 3)}}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_run, 2, args=(str(tmp_path_factory.mktemp("save_rules")),), timeout=300)


def test_tag_validation_fail_refuses_on_every_rank(results: list[dict]) -> None:
    for res in results:
        fail = res["tags"]["Fail"]
        assert fail["error"] is not None and "different tags" in fail["error"] and "\n" not in fail["error"]
        assert "tag_validation" in fail["error"]
        assert fail["assertion"]                               # DeepSpeed's scripts catch AssertionError
        assert fail["dirs"] == []                              # nothing written


@pytest.mark.parametrize("mode", ["Warn", None, "Ignore"])
def test_tag_validation_warn_and_ignore_save_under_rank0s_tag(results: list[dict], mode: str | None) -> None:
    for res in results:
        got = res["tags"][mode]
        assert got["error"] is None
        assert ("step1_rank0" in got["dirs"]) and ("step1_rank1" not in got["dirs"])
        assert len(got["warned"]) == (0 if mode == "Ignore" else 1)


def test_empty_save_dir_is_refused_in_one_line(results: list[dict]) -> None:
    for res in results:
        for name in ("empty_dir", "none_dir"):
            line = res["tags"][name]
            assert line is not None and "save_dir" in line and "\n" not in line and "not a ValueError" not in line


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_exclude_frozen_parameters(results: list[dict], stage: int) -> None:
    res0 = results[0][f"frozen{stage}"]
    for keys in res0["keys"]:
        assert FROZEN not in keys and "embed.tok.weight" in keys
    for res in results:
        strict = res[f"frozen{stage}"]["strict"]
        assert strict is not None and FROZEN in strict and "load_module_strict=False" in strict
    saved, loaded = res0["saved"], res0["loaded"]
    for name, value in saved.items():
        if name == FROZEN:
            assert torch.equal(loaded[name], res0["built"]), "the frozen weight is not the model's own"
            assert not torch.equal(loaded[name], value)
        else:
            assert torch.equal(loaded[name], value), name
