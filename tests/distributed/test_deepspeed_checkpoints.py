"""Checkpoints cross with DeepSpeed 0.19 both ways, at ZeRO stages 0-3 (fp32, 2 gloo ranks, DeepSpeed on CPU with
torch's Adam). Per stage, in one pair of spawned ranks:

- DeepSpeed trains SAVE_AT steps and saves, then continues AFTER steps: its next losses. shardwise, built fresh,
  loads DeepSpeed's tag and trains the same AFTER steps: the same losses. The first of them comes from the loaded
  weights alone and is bitwise DeepSpeed's; the later ones follow updates whose arithmetic is the same up to the
  summation order of the clip norm (`test_deepspeed_parity.py`: rtol 1e-5).
- The reverse: shardwise trains and saves, continues; DeepSpeed, built fresh, loads shardwise's tag and continues.
- DeepSpeed's zero_to_fp32 (`get_fp32_state_dict_from_zero_checkpoint`) on shardwise's tag gives shardwise's
  consolidated weights bitwise (stages 1-3; at stage 0 DeepSpeed's tool reads no checkpoint, its own neither).
- The counters, the scheduler's lr and the client state come back on both sides.
- Every file of shardwise's tags (DeepSpeed's partition, layer and per-rank ZeRO-3 files too) has its size and
  CRC-32 in the index; DeepSpeed's tags (no index of ours) load unverified, said once per tag.
Also: DeepSpeed's tag at another layout (tensor_parallel 2, so dp 1: resharded through the index), the
load_module_only / load_optimizer_states=False variants against DeepSpeed's own, DeepSpeed's universal
checkpoint (ds_to_universal.py), a PipelineModule's tag (2 stages, ZeRO-1) both ways, and bf16 at stages 0-3.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.testing import assert_close_lists, run_distributed, tiny_gpt, token_batches

pytest.importorskip("deepspeed")

WORLD, SEQ, BATCH, SAVE_AT, AFTER = 2, 16, 8, 2, 3
LOSS_RTOL = 1e-5        # fp32 after an update: the clip norm's summation order differs (see the module docstring)


def config(stage: int, **extra) -> dict:
    cfg = {"train_batch_size": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
           "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3,
                                                        "warmup_num_steps": 4, "warmup_type": "linear"}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                 "stage3_param_persistence_threshold": 40}}
    cfg.update(extra)
    return cfg


def _deepspeed():
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


def _steps(engine, first: int, n: int) -> list[float]:
    """Global batches first .. first + n - 1, this rank's rows, DeepSpeed's loop."""
    dp = engine.dp_world_size if hasattr(engine, "dp_world_size") and not callable(engine.dp_world_size) \
        else engine.dp_size
    rank = torch.distributed.get_rank() % dp if dp > 1 else 0
    losses = []
    for step in range(first, first + n):
        rows = token_batches(1, BATCH, SEQ + 1, seed=100 + step)[0]
        mine = rows.view(dp, BATCH // dp, SEQ + 1)[rank]
        loss = engine(mine[:, :-1], mine[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


class _LinearGuard:
    """DeepSpeed's ZeRO-3 swaps torch.nn.functional.linear for its own and leaves it: put torch's back."""

    def __enter__(self):
        self.linear = torch.nn.functional.linear

    def __exit__(self, *exc):
        torch.nn.functional.linear = self.linear


def _ds_engine(deepspeed, cfg: dict):
    model = tiny_gpt(seq_len=SEQ)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))
    return engine


def _sw_engine(cfg: dict):
    import shardwise
    model = tiny_gpt(seq_len=SEQ, seed=99)        # other initial weights: the load must replace them all
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))
    return engine


def _both_ways(root: str, stage: int) -> dict:
    import torch.distributed as dist
    deepspeed = _deepspeed()
    out: dict = {}
    cfg = config(stage)
    ds_dir, sw_dir = f"{root}/ds{stage}", f"{root}/sw{stage}"
    with _LinearGuard():
        ds = _ds_engine(deepspeed, cfg)
        _steps(ds, 0, SAVE_AT)
        ds.save_checkpoint(ds_dir, client_state={"epoch": 7, "note": "ds"})
        out["ds_continued"] = _steps(ds, SAVE_AT, AFTER)
        out["ds_lr"] = ds.get_lr()
        del ds
    sw = _sw_engine(cfg)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        path, client = sw.load_checkpoint(ds_dir)
        sw.load_checkpoint(ds_dir)          # the same tag again: said already
    out["unverified_said"] = [str(w.message) for w in said if "without checking" in str(w.message)]
    out["sw_loaded_client"], out["sw_loaded_steps"] = client, sw.global_steps
    out["sw_from_ds"] = _steps(sw, SAVE_AT, AFTER)
    out["sw_lr"] = sw.get_lr()
    sw.close()

    sw = _sw_engine(cfg)
    torch.manual_seed(0)
    sw.load_checkpoint(ds_dir, load_module_only=True)        # weights only: a fresh optimizer and step 0
    out["sw_module_only"] = (_steps(sw, SAVE_AT, AFTER), sw.global_steps)
    sw.close()
    sw = _sw_engine(cfg)
    sw.load_checkpoint(ds_dir, load_optimizer_states=False)  # weights, counters, scheduler; fresh moments
    out["sw_no_optimizer"] = (_steps(sw, SAVE_AT, AFTER), sw.global_steps)
    sw.close()
    with _LinearGuard():
        ds = _ds_engine(deepspeed, cfg)
        ds.load_checkpoint(ds_dir, load_module_only=True)
        out["ds_module_only"] = (_steps(ds, SAVE_AT, AFTER), ds.global_steps)
        del ds
        ds = _ds_engine(deepspeed, cfg)
        ds.load_checkpoint(ds_dir, load_optimizer_states=False)
        out["ds_no_optimizer"] = (_steps(ds, SAVE_AT, AFTER), ds.global_steps)
        del ds
    if stage == 1:          # the scheduler starts over (its warm-up again); the optimizer's lr is the saved one
        with _LinearGuard():
            ds = _ds_engine(deepspeed, cfg)
            ds.load_checkpoint(ds_dir, load_lr_scheduler_states=False)
            out["ds_no_scheduler"] = (_steps(ds, SAVE_AT, AFTER), ds.global_steps)
            del ds
        sw = _sw_engine(cfg)
        sw.load_checkpoint(ds_dir, load_lr_scheduler_states=False)
        out["sw_no_scheduler"] = (_steps(sw, SAVE_AT, AFTER), sw.global_steps)
        sw.close()

    sw = _sw_engine(cfg)
    sw.load_checkpoint(ds_dir)      # start from the same weights as DeepSpeed's run, then save our own tag
    sw.save_checkpoint(sw_dir, client_state={"epoch": 8})
    full = sw.consolidated_state_dict()        # the weights saved (world rank 0; None elsewhere)
    full = {k: v.detach().clone() for k, v in full.items()} if full is not None else None     # not the live ones
    out["sw_continued"] = _steps(sw, SAVE_AT, AFTER)
    sw.close()
    with _LinearGuard():
        ds = _ds_engine(deepspeed, cfg)
        path, client = ds.load_checkpoint(sw_dir)
        out["ds_loaded_client"], out["ds_loaded_steps"] = client.get("epoch"), ds.global_steps
        out["ds_from_sw"] = _steps(ds, SAVE_AT, AFTER)
        del ds
    if dist.get_rank() == 0 and stage > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        theirs = get_fp32_state_dict_from_zero_checkpoint(sw_dir)
        out["zero_to_fp32"] = {k: torch.equal(theirs[k].contiguous() if hasattr(theirs[k], "contiguous") else
                                              theirs[k], v) for k, v in full.items()}
        out["zero_to_fp32_extra"] = sorted(set(theirs) - set(full))
        if stage == 3:      # the script as users run it (a copy beside the checkpoints): one pytorch_model.bin
            import deepspeed.utils.zero_to_fp32 as tool
            shutil.copy(tool.__file__, f"{sw_dir}/zero_to_fp32.py")
            subprocess.run([sys.executable, f"{sw_dir}/zero_to_fp32.py", sw_dir, f"{root}/fp32_{stage}"], check=True,
                           capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
            script = torch.load(f"{root}/fp32_{stage}/pytorch_model.bin", weights_only=True)
            out["zero_to_fp32_script"] = script.keys() == full.keys() and all(torch.equal(script[k], v)
                                                                             for k, v in full.items())
    if stage == 2:
        # DeepSpeed's tag at tensor_parallel 2 (dp 1): resharded through the index
        sw = _sw_engine({**cfg, "tensor_parallel": {"size": 2}})
        sw.load_checkpoint(ds_dir)
        out["sw_tp2_from_ds"] = _steps(sw, SAVE_AT, AFTER)
        sw.close()
        # DeepSpeed's universal checkpoint of the same tag (ds_to_universal.py), loaded at ZeRO-3
        universal = f"{root}/universal"
        if dist.get_rank() == 0:
            import deepspeed.checkpoint.ds_to_universal as tool
            subprocess.run([sys.executable, tool.__file__, "--input_folder", f"{ds_dir}/global_step{SAVE_AT}",
                            "--output_folder", f"{universal}/global_step{SAVE_AT}_universal", "--inject_missing_state",
                            "--num_extract_workers", "1", "--num_merge_workers", "1"],
                           check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
        dist.barrier()
        sw = _sw_engine(config(3))
        path, client = sw.load_checkpoint(universal)         # its `latest_universal`
        out["sw_from_universal"] = (_steps(sw, SAVE_AT, AFTER), path, client.get("epoch"))
        sw.close()
    return out


class Block(nn.Module):
    """Pre-norm residual MLP over [b, h]."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.ln(x))))


def _pipeline_net(pipe):
    layers = [pipe.LayerSpec(nn.Linear, 8, 16), *[pipe.LayerSpec(Block, 16) for _ in range(3)],
              pipe.LayerSpec(nn.Linear, 16, 4)]
    return pipe.PipelineModule(layers=layers, loss_fn=nn.MSELoss(), num_stages=2, partition_method="uniform")


def _pipeline_batches(first: int, n: int) -> list:
    """Micro-batches (x [2, 8], y [2, 4]) of global batches first .. first + n - 1 (2 micro-batches each)."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(2 * (first + n))]
    return data[2 * first:]


def _pipeline(root: str) -> dict:
    """DeepSpeed's PipelineModule over 2 stages (dp 1), ZeRO-1, Adam: its tag resumes under shardwise's
    PipelineModule of the same layers, and shardwise's tag under DeepSpeed's."""
    deepspeed = _deepspeed()
    from deepspeed import pipe as ds_pipe
    from shardwise import pipe
    import shardwise
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "steps_per_print": 1 << 30, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = _pipeline_net(ds_pipe)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=copy.deepcopy(cfg))
    data = iter(_pipeline_batches(0, SAVE_AT + AFTER))
    for _ in range(SAVE_AT):
        engine.train_batch(data_iter=data)
    engine.save_checkpoint(f"{root}/pipe")
    theirs = [float(engine.train_batch(data_iter=data)) for _ in range(AFTER)]
    del engine
    torch.manual_seed(5)
    net = _pipeline_net(pipe)
    engine, *_ = shardwise.initialize(model=net, model_parameters=list(net.parameters()), config=copy.deepcopy(cfg))
    engine.load_checkpoint(f"{root}/pipe")
    engine.save_checkpoint(f"{root}/pipe_sw")          # per-layer files, as DeepSpeed's PipelineModule
    data = iter(_pipeline_batches(SAVE_AT, AFTER))
    ours = [float(engine.train_batch(data)) for _ in range(AFTER)]
    steps = engine.global_steps
    engine.close()
    torch.manual_seed(7)
    net = _pipeline_net(ds_pipe)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=copy.deepcopy(cfg))
    engine.load_checkpoint(f"{root}/pipe_sw")
    data = iter(_pipeline_batches(SAVE_AT, AFTER))
    ds_from_sw = [float(engine.train_batch(data_iter=data)) for _ in range(AFTER)]
    del engine
    return {"theirs": theirs, "ours": ours, "steps": steps, "ds_from_sw": ds_from_sw}


def _bf16(root: str, stage: int) -> dict:
    """bf16 (bf16 weights, fp32 masters): DeepSpeed's tag under shardwise, shardwise's tag (saved right after
    that load) under DeepSpeed."""
    deepspeed = _deepspeed()
    cfg = config(stage, bf16={"enabled": True})
    ds_dir, sw_dir = f"{root}/bf16_ds{stage}", f"{root}/bf16_sw{stage}"
    out: dict = {}
    with _LinearGuard():
        ds = _ds_engine(deepspeed, cfg)
        _steps(ds, 0, SAVE_AT)
        ds.save_checkpoint(ds_dir)
        out["ds_continued"] = _steps(ds, SAVE_AT, AFTER)
        del ds
    sw = _sw_engine(cfg)
    sw.load_checkpoint(ds_dir)
    sw.save_checkpoint(sw_dir)
    out["sw_from_ds"] = _steps(sw, SAVE_AT, AFTER)
    sw.close()
    with _LinearGuard():
        ds = _ds_engine(deepspeed, cfg)
        ds.load_checkpoint(sw_dir)
        out["ds_from_sw"] = _steps(ds, SAVE_AT, AFTER)
        del ds
    return out


def _frozen(root: str) -> dict:
    """exclude_frozen_parameters=True at ZeRO-2 (the position table frozen): DeepSpeed's strict load of our tag
    refuses it, its non-strict load takes the rest and keeps its own frozen table."""
    deepspeed = _deepspeed()
    cfg = config(2)

    def frozen(model):
        model.get_parameter("embed.pos.weight").requires_grad_(False)
        return model

    import shardwise
    model = frozen(tiny_gpt(seq_len=SEQ, seed=99))
    sw, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))
    _steps(sw, 0, SAVE_AT)
    sw.save_checkpoint(f"{root}/frozen", exclude_frozen_parameters=True)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sw.close()
    out: dict = {}
    with _LinearGuard():
        model = frozen(tiny_gpt(seq_len=SEQ))
        ds, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))
        built = model.state_dict()["embed.pos.weight"].clone()
        try:
            ds.load_checkpoint(f"{root}/frozen")
            out["strict"] = None
        except RuntimeError as e:
            out["strict"] = str(e)
        del ds
        model = frozen(tiny_gpt(seq_len=SEQ))
        ds, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))
        ds.load_checkpoint(f"{root}/frozen", load_module_strict=False)
        loaded = model.state_dict()
        out["same"] = {k: torch.equal(loaded[k], saved[k] if k != "embed.pos.weight" else built) for k in saved}
        del ds
    return out


def _unrecorded(tag: Path) -> list[str]:
    """The files of a shardwise tag that its index does not record as they are on disk (size and CRC-32), and
    the files it records that are not there."""
    from shardwise.checkpoint import files as ckpt
    from shardwise.checkpoint.index import INDEX, read_index
    index = read_index(tag)
    assert index is not None
    sums = dict(index.checksums)
    on_disk = {p.name for p in tag.iterdir() if p.name != INDEX}
    return sorted(on_disk ^ set(sums)) + [n for n in sorted(on_disk & set(sums)) if ckpt.file_sum(tag / n) != sums[n]]


def _run(root: str) -> dict:
    import torch.distributed as dist
    torch.set_num_threads(1)
    out: dict = {stage: _both_ways(root, stage) for stage in (0, 1, 2, 3)}
    out["bf16"] = {stage: _bf16(root, stage) for stage in (0, 1, 2, 3)}
    out["frozen"] = _frozen(root)
    out["pipeline"] = _pipeline(root)          # last: DeepSpeed's pipeline leaves its model-parallel grid set
    dist.barrier()
    if dist.get_rank() == 0:                   # every tag shardwise wrote: the sums of all its files
        out["unrecorded"] = {str(index.parent.relative_to(root)): _unrecorded(index.parent)
                             for index in sorted(Path(root).glob("*/*/shardwise_index.pt"))}
        out["files_summed"] = {str(index.parent.relative_to(root)): sorted(p.name for p in index.parent.iterdir())
                               for index in sorted(Path(root).glob("*/*/shardwise_index.pt"))}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("ds_ckpt")
    return run_distributed(_run, WORLD, args=(str(root),), timeout=600)


def _same_next_losses(ours: list[float], theirs: list[float], what: str) -> None:
    assert ours[0] == theirs[0], f"{what}: the first loss after the load differs: {ours[0]!r} vs {theirs[0]!r}"
    assert_close_lists(ours, theirs, rtol=LOSS_RTOL, what=what)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_checkpoint_resumes_under_shardwise(results: list[dict], stage: int) -> None:
    for rank, res in enumerate(results):
        r = res[stage]
        _same_next_losses(r["sw_from_ds"], r["ds_continued"], f"stage {stage} rank {rank}")
        assert r["sw_loaded_steps"] == SAVE_AT
        assert r["sw_loaded_client"]["epoch"] == 7 and r["sw_loaded_client"]["note"] == "ds"
        assert_close_lists(r["sw_lr"], r["ds_lr"], rtol=1e-12, what="lr after the steps")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shardwise_checkpoint_resumes_under_deepspeed(results: list[dict], stage: int) -> None:
    for rank, res in enumerate(results):
        r = res[stage]
        _same_next_losses(r["ds_from_sw"], r["sw_continued"], f"stage {stage} rank {rank}")
        assert r["ds_loaded_steps"] == SAVE_AT and r["ds_loaded_client"] == 8


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_load_variants_match_deepspeed(results: list[dict], stage: int) -> None:
    """load_module_only: weights only (step 0, fresh Adam); load_optimizer_states=False: weights, counters and
    scheduler, fresh moments; load_lr_scheduler_states=False (stage 1): all but the scheduler; as DeepSpeed does
    each. One deliberate difference: DeepSpeed's load_module_only at
    ZeRO-3 loads its module states, which hold only placeholders there, so its model keeps the weights it was
    built with; shardwise loads the saved weights (from the optimizer files' masters)."""
    for rank, res in enumerate(results):
        r = res[stage]
        if stage == 3:
            ours, our_steps = r["sw_module_only"]
            assert ours[0] == r["ds_continued"][0] and our_steps == AFTER      # counted from 0
            assert r["ds_module_only"][0][0] != r["ds_continued"][0]      # DeepSpeed's: the built weights
        keys = ("no_optimizer",) if stage == 3 else ("module_only", "no_optimizer")
        for key in keys + (("no_scheduler",) if stage == 1 else ()):
            (ours, our_steps), (theirs, their_steps) = r[f"sw_{key}"], r[f"ds_{key}"]
            _same_next_losses(ours, theirs, f"stage {stage} {key} rank {rank}")
            assert our_steps == their_steps, f"stage {stage} {key}: global_steps {our_steps} vs {their_steps}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_to_fp32_reads_shardwise_checkpoints(results: list[dict], stage: int) -> None:
    r = results[0][stage]
    assert all(r["zero_to_fp32"].values()), [k for k, same in r["zero_to_fp32"].items() if not same]
    assert r["zero_to_fp32_extra"] == []
    if stage == 3:
        assert r["zero_to_fp32_script"]


def test_deepspeed_checkpoint_reshards(results: list[dict]) -> None:
    """DeepSpeed's dp=2 ZeRO-2 tag loaded at tensor_parallel 2 (dp 1): the same next losses, up to the
    summation order tensor parallelism changes (rtol 1e-5, as `test_reshard.py`). A dp=1 rank's loss is the
    whole batch's: the mean of DeepSpeed's two ranks' half batches."""
    theirs = [(a + b) / 2 for a, b in zip(results[0][2]["ds_continued"], results[1][2]["ds_continued"])]
    for rank, res in enumerate(results):
        assert_close_lists(res[2]["sw_tp2_from_ds"], theirs, rtol=LOSS_RTOL, what=f"tp2 rank {rank}")


def test_deepspeed_universal_checkpoint_resumes_under_shardwise(results: list[dict]) -> None:
    """ds_to_universal.py's output of DeepSpeed's ZeRO-2 tag, loaded at ZeRO-3: DeepSpeed's next losses."""
    for rank, res in enumerate(results):
        losses, path, epoch = res[2]["sw_from_universal"]
        assert path.endswith(f"global_step{SAVE_AT}_universal") and epoch == 7
        _same_next_losses(losses, res[2]["ds_continued"], f"universal rank {rank}")


def test_pipeline_checkpoints_cross_both_ways(results: list[dict]) -> None:
    """DeepSpeed's PipelineModule tag (per-layer files, ZeRO-1 shards per stage) under shardwise's, and the
    reverse."""
    for rank, res in enumerate(results):
        r = res["pipeline"]
        _same_next_losses(r["ours"], r["theirs"], f"pipeline rank {rank}")
        _same_next_losses(r["ds_from_sw"], r["ours"], f"pipeline, DeepSpeed from shardwise, rank {rank}")
        assert r["steps"] == SAVE_AT + AFTER


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_checkpoints_cross_both_ways(results: list[dict], stage: int) -> None:
    """DeepSpeed continuing from shardwise's tag (written from DeepSpeed's, loaded by shardwise) takes exactly
    the steps DeepSpeed takes from its own: nothing is lost either way (at stage 0 DeepSpeed's state is its
    FP16_UnfusedOptimizer's: the fp32 masters beside torch's). At stages 0-2 shardwise's next losses are
    DeepSpeed's bit for bit; at stage 3 the two engines' bf16 forwards differ (DeepSpeed's ZeRO-3 runs Linear
    through its own autograd function), so only the round trip is compared there."""
    for rank, res in enumerate(results):
        r = res["bf16"][stage]
        assert r["ds_from_sw"] == r["ds_continued"], f"bf16 stage {stage} rank {rank}"
        if stage < 3:
            assert r["sw_from_ds"] == r["ds_continued"], f"bf16 stage {stage} rank {rank}"


def test_every_file_of_shardwise_tags_is_summed(results: list[dict]) -> None:
    """The index of each tag shardwise wrote (stages 0-3, bf16, exclude_frozen, the pipeline) records every other
    file of the tag at its size and CRC-32 on disk: also DeepSpeed's partitions (rewritten after the first pass),
    its per-layer files and its ZeRO-3 model states of every dp rank."""
    unrecorded, files = results[0]["unrecorded"], results[0]["files_summed"]
    assert len(unrecorded) == 10, sorted(unrecorded)        # sw0-3, bf16_sw0-3, frozen, pipe_sw
    assert all(not problems for problems in unrecorded.values()), unrecorded
    names = {n for tag in files.values() for n in tag}
    for kind in ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_model_states.pt", "layer_04-model_states.pt"):
        assert kind in names, kind


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_tags_load_unverified_said_once(results: list[dict], stage: int) -> None:
    """DeepSpeed's tag carries no checksums: shardwise loads it (through the index it builds from DeepSpeed's
    metadata) and says so once per tag, however often it loads it."""
    for res in results:
        said = res[stage]["unverified_said"]
        assert len(said) == 1 and "DeepSpeed" in said[0], said


def test_frozen_parameters_left_out_load_in_deepspeed_non_strict(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        r = res["frozen"]
        assert r["strict"] is not None and "embed.pos.weight" in r["strict"], r["strict"]
        assert all(r["same"].values()), [k for k, same in r["same"].items() if not same]
