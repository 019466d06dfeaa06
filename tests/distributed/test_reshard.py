"""Checkpoints load at any layout: save at one (dp, tp, pp, ZeRO stage, offload), load at others, and the next
steps' losses equal continuing at the layout that saved (fp32, rtol 1e-5; the global batch is the same, the
summation order is not). One spawn per save layout; each loads at several layouts of the same world size.

Also here: a checkpoint that cannot be loaded (another model, a damaged file) is refused with the same line on
every rank before anything changes; a changed gradient_accumulation_steps resumes at the step boundary; SGD's
momentum, bf16 with fp32 masters and tied embeddings under ZeRO-3 reshard too; ZeRO-2 shards read at a ZeRO-3 layout
holding the same pieces (every parameter persistent) are resharded, not read as-is; a checkpoint without its index
(an earlier shardwise's) loads exactly at its own layout and is refused at another.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from shardwise.testing import assert_close_growing, assert_close_lists, micro_steps, run_distributed, tiny_gpt, token_batches

SEQ, BATCH, SAVE_AT, AFTER = 16, 8, 1, 3


def _engine(layout: dict, *, seed: int = 1234, **model):
    import shardwise
    import torch.distributed as dist
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    dp = dist.get_world_size() // (tp * pp)
    # "persist": every ZeRO-3 parameter persistent, so its buckets hold what ZeRO-2's hold, in ZeRO-3's format
    zero = {"stage": layout.get("zero", 0), "reduce_bucket_size": 1500,
            "stage3_param_persistence_threshold": 10**9 if layout.get("persist") else 40}
    if layout.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    lr = 0.3 if layout.get("sgd") else 3e-3       # SGD's steps move a loss far less than Adam's at one lr
    optimizer = {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}} if layout.get("sgd") else \
        {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.1}}
    config = {"train_batch_size": BATCH, "gradient_accumulation_steps": layout.get("ga", 2),
              "gradient_clipping": 0.5, "zero_optimization": zero, "optimizer": optimizer,
              "bf16": {"enabled": bool(layout.get("bf16"))},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_min_lr": lr / 3,
                                                          "warmup_max_lr": lr}}}
    if tp > 1:
        config["tensor_parallel"] = {"size": tp}
    if pp > 1:
        config["pipeline"] = {"stages": pp, "schedule": "1f1b"}
    net = tiny_gpt(n_layer=model.pop("n_layer", 2), seq_len=SEQ, seed=seed, **model)
    engine, *_ = shardwise.initialize(model=net, model_parameters=net.parameters(), config=config)
    assert engine.dp_size == dp
    return engine


def _train(engine, first: int, n: int) -> list[float]:
    """Global batches first .. first + n - 1 (each drawn from its own seed), this rank's micro-batches."""
    ga = engine.gradient_accumulation_steps()
    rows = [token_batches(1, BATCH, SEQ + 1, seed=step)[0] for step in range(first, first + n)]
    return [float(engine.train_batch(iter(b)))
            for b in micro_steps(rows, dp_size=engine.dp_size, dp_rank=engine.dp_rank, grad_accum=ga)]


def _weights(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _refused(engine, root: str, **kw) -> tuple[str, bool]:
    """The error of loading `root` and whether the module's tensors stayed exactly as they were."""
    from shardwise.checkpoint.files import CheckpointError
    before = _weights(engine)
    try:
        engine.load_checkpoint(root, **kw)
        message = ""
    except CheckpointError as e:
        message = str(e)
    after = _weights(engine)
    return message, all(torch.equal(before[k], after[k]) for k in before)


def _save_then_load(root: str, saved: dict, loads: list[dict], refusals: bool, legacy: dict | None) -> dict:
    torch.set_num_threads(1)
    engine = _engine(saved)
    _train(engine, 0, SAVE_AT)
    engine.save_checkpoint(root)
    out = {"continued": _train(engine, SAVE_AT, AFTER)}
    engine.close()
    for i, layout in enumerate(loads):
        other = _engine(layout, seed=99)             # another start: only the checkpoint can make it equal
        other.load_checkpoint(root)
        out[i] = {"steps": other.global_steps, "micro": other.micro_steps, "losses": _train(other, SAVE_AT, AFTER)}
        other.close()
    if refusals:
        out["refused"] = _refusals(root, saved)
    if legacy is not None:
        out["legacy"] = _legacy(root, saved, legacy)
        out["tied"] = _tied(f"{root}/tied")
        for name, (first, others) in EXTRA.items():
            out[name] = _save_then_load(f"{root}/{name}", first, others, False, None)
    return out


def _tied(root: str) -> dict:
    """Tied embeddings under ZeRO-3: the lm-head's placeholder takes the embedding's fragments."""
    engine = _engine({"zero": 3}, tie_embeddings=True)
    _train(engine, 0, SAVE_AT)
    engine.save_checkpoint(root)
    out = {"continued": _train(engine, SAVE_AT, AFTER)}
    engine.close()
    for stage in (0, 3):
        other = _engine({"zero": stage}, seed=99, tie_embeddings=True)
        other.load_checkpoint(root)
        out[stage] = _train(other, SAVE_AT, AFTER)
        other.close()
    return out


def _legacy(root: str, saved: dict, other: dict) -> dict:
    """A checkpoint without an index (as an earlier shardwise wrote them) loads at its own layout, exactly, and
    is refused at another before anything changes."""
    import torch.distributed as dist
    if dist.get_rank() == 0:
        shutil.copytree(Path(root, f"global_step{SAVE_AT}"), Path(root, "legacy"))
        Path(root, "legacy", "shardwise_index.pt").unlink()
        # An earlier shardwise wrote neither the index nor DeepSpeed's metadata (with it, a tag without its index
        # reads as DeepSpeed's, which loads at any layout: test_deepspeed_checkpoints.py).
        for file in Path(root, "legacy").glob("*model_states.pt"):
            states = torch.load(file, weights_only=False)
            del states["buffer_names"], states["ds_version"]
            torch.save(states, file)
    dist.barrier()
    engine = _engine(saved, seed=99)
    engine.load_checkpoint(root, tag="legacy")
    out = {"losses": _train(engine, SAVE_AT, AFTER)}
    engine.close()
    engine = _engine(other, seed=99)
    out["refused"] = _refused(engine, root, tag="legacy")
    engine.close()
    return out


def _refusals(root: str, saved: dict) -> dict:
    import torch.distributed as dist
    out = {}
    for what, model in (("deeper", {"n_layer": 3}), ("shallower", {"n_layer": 1}), ("wider", {"d_model": 64})):
        engine = _engine(saved, seed=7, **model)
        out[what] = _refused(engine, root)
        engine.close()
    engine = _engine(dict(saved, sgd=True), seed=7)               # the same model, another optimizer
    out["optimizer"] = _refused(engine, root)
    engine.close()
    # A damaged shard: a copy of the tag with one optimizer file cut short.
    tag = Path(root, f"global_step{SAVE_AT}")
    if dist.get_rank() == 0:
        shutil.copytree(tag, Path(root, "damaged"))
        victim = sorted(Path(root, "damaged").glob("zero_pp_rank_*"))[-1]
        victim.write_bytes(victim.read_bytes()[:1000])
    dist.barrier()
    engine = _engine(saved, seed=7)
    out["truncated"] = _refused(engine, root, tag="damaged")
    engine.close()
    return out


# Two more optimizers' states on 2 ranks (spawned with the case below that has `legacy`): SGD's momentum, and
# bf16 (model and gradients bf16, fp32 masters): compared like the bf16 parity tests, n * eps / 64 after n updates.
EXTRA = {"sgd": ({"zero": 2, "sgd": True}, [{"zero": 0, "tp": 2, "sgd": True}, {"zero": 3, "sgd": True}]),
         "bf16": ({"zero": 1, "bf16": True}, [{"zero": 3, "bf16": True}, {"zero": 0, "bf16": True}])}

# save layout, world size, load layouts (same world size), whether the refusals run there, a layout at which
# the same checkpoint without its index is refused
CASES = {
    "zero2-dp4": ({"zero": 2}, 4, [{"zero": 0}, {"zero": 3, "ga": 1}, {"zero": 1, "tp": 2},
                                   {"zero": 3, "pp": 2, "offload": True}, {"zero": 0, "tp": 2, "pp": 2},
                                   {"zero": 3, "persist": True}], True, None),
    "zero1-tp2-pp2": ({"zero": 1, "tp": 2, "pp": 2}, 4, [{"zero": 2, "ga": 1}, {"zero": 3, "tp": 2},
                                                         {"zero": 0, "pp": 2}, {"zero": 1, "tp": 2, "pp": 2}],
                      False, None),
    "zero3-offload-dp2": ({"zero": 3, "offload": True}, 2, [{"zero": 0}, {"zero": 1, "ga": 4}, {"zero": 2, "tp": 2},
                                                           {"zero": 3}, {"zero": 0, "pp": 2}], False, {"zero": 0}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_checkpoint_loads_at_other_layouts(tmp_path: Path, name: str) -> None:
    saved, world, loads, refusals, legacy = CASES[name]
    results = run_distributed(_save_then_load, world, args=(str(tmp_path), saved, loads, refusals, legacy),
                              timeout=400)
    for rank, res in enumerate(results):
        for i, layout in enumerate(loads):
            got = res[i]
            assert_close_lists(got["losses"], res["continued"], rtol=1e-5,
                               what=f"rank {rank}: saved at {saved}, loaded at {layout}")
            assert got["steps"] == SAVE_AT
            assert got["micro"] == SAVE_AT * layout.get("ga", 2)       # derived from the step, not restored
    if refusals:
        for what in ("deeper", "shallower", "wider", "optimizer", "truncated"):
            lines = {res["refused"][what][0] for res in results}
            assert len(lines) == 1, f"{what}: ranks disagree: {lines}"
            line = lines.pop()
            assert line and "\n" not in line, what
            assert all(res["refused"][what][1] for res in results), f"{what}: weights changed before the refusal"
        assert "no tensor 'blocks.2." in results[0]["refused"]["deeper"][0]
        assert "does not have (e.g. 'blocks.1." in results[0]["refused"]["shallower"][0]
        assert "in the checkpoint but" in results[0]["refused"]["wider"][0]
        assert "written with another optimizer" in results[0]["refused"]["optimizer"][0]
        assert "damaged/zero_pp_rank_" in results[0]["refused"]["truncated"][0]
        assert "truncated or corrupt" in results[0]["refused"]["truncated"][0]
    if legacy is not None:
        for rank, res in enumerate(results):
            for i, layout in enumerate(EXTRA["sgd"][1]):
                assert_close_lists(res["sgd"][i]["losses"], res["sgd"]["continued"], rtol=1e-5,
                                   what=f"rank {rank}: SGD, ZeRO-2 -> {layout}")
            for i, layout in enumerate(EXTRA["bf16"][1]):
                assert_close_growing(res["bf16"][i]["losses"], res["bf16"]["continued"],
                                     rtol_per_step=torch.finfo(torch.bfloat16).eps / 64, steps=range(AFTER),
                                     what=f"rank {rank}: bf16, ZeRO-1 -> {layout}")
            for stage in (0, 3):
                assert_close_lists(res["tied"][stage], res["tied"]["continued"], rtol=1e-5,
                                   what=f"rank {rank}: tied embeddings, ZeRO-3 -> {stage}")
            assert_close_lists(res["legacy"]["losses"], res["continued"], rtol=0, what=f"rank {rank}: legacy")
        lines = {res["legacy"]["refused"][0] for res in results}
        assert len(lines) == 1 and "without a layout index" in lines.pop()
        assert all(res["legacy"]["refused"][1] for res in results)
