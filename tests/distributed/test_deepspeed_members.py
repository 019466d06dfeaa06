"""DeepSpeed's engine members that scripts and integrations (Hugging Face's Trainer, Accelerate, Lightning,
Megatron-DeepSpeed) read, checked member by member against DeepSpeed 0.19 itself: one script, written against
`import shardwise as deepspeed`, run at 2 ranks with shardwise and with DeepSpeed (DS_ACCELERATOR=cpu, gloo), on
the same model, data and config. For each member the kind (method or attribute) must match, and so must the value.

Three scripts:
- DeepSpeedEngine, ZeRO-1 with a config optimizer and scheduler, accumulation 2, clipping: every member read after
  one step driven as Accelerate drives it (`set_gradient_accumulation_boundary` before each backward, `step()` on
  the boundary only), then one plain step; losses and counters compared too.
- the same under ZeRO-3 with CPU optimizer offload and a 16-bit gather on save: the ZeRO getters' other values.
- PipelineEngine over a 2-stage `pipe.PipelineModule`: its stage members and grid.

Values. Losses: rtol 1e-5, as the other fp32 parity tests. Everything else is configuration or arithmetic on
integers and is compared exactly; sequences are compared as lists (torch keeps `betas` as the tuple or list given).
"""

from __future__ import annotations

import copy
import importlib
import inspect
from typing import Any

import pytest
import torch

from test_deepspeed_parity import _import_deepspeed
from shardwise.testing import assert_close_lists, run_distributed, shard_global_batch, tiny_gpt, token_batches

WORLD = 2
SEQ = 16

ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01,
                                     "torch_adam": True}}
ZERO1 = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
         "gradient_clipping": 0.5, "steps_per_print": 1000, "optimizer": ADAMW,
         "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                      "warmup_num_steps": 4}},
         "zero_optimization": {"stage": 1, "reduce_bucket_size": 3000, "allgather_bucket_size": 5000}}
ZERO3 = {**ZERO1, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 100,
    "stage3_prefetch_bucket_size": 2000, "stage3_max_live_parameters": 10 ** 7, "stage3_max_reuse_distance": 10 ** 7,
    "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 10 ** 6, "reduce_bucket_size": 3000}}
# Clipping off: DeepSpeed's PipelineEngine clips fp32 gradients by a norm that counts only the parameters of the
# grid's model-parallel rank 0 (stage 0) unless they are marked model-parallel; shardwise clips by the whole
# model's norm, the single-process one.
PIPE = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}

# Members of DeepSpeedEngine that are attributes (or properties) in DeepSpeed, and those that are methods.
ATTRIBUTES = ("world_size", "dp_world_size", "mp_world_size", "local_rank", "global_rank", "global_steps",
              "global_samples", "micro_steps", "skipped_steps", "communication_data_type", "training_dataloader")
METHODS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "get_batch_info",
           "gradient_clipping", "loss_scale", "dynamic_loss_scale", "steps_per_print", "wall_clock_breakdown",
           "memory_breakdown", "dataloader_drop_last", "postscale_gradients", "gradient_predivide_factor",
           "optimizer_name", "optimizer_params", "scheduler_name", "scheduler_params", "get_lr", "get_mom",
           "was_step_applied", "is_gradient_accumulation_boundary", "fp16_enabled", "bfloat16_enabled",
           "zero_optimization", "zero_optimization_stage", "zero_optimization_partition_gradients",
           "zero_optimization_partition_weights", "zero_cpu_offload", "zero_use_cpu_optimizer",
           "zero_allow_untested_optimizer", "zero_reduce_bucket_size", "zero_allgather_bucket_size",
           "zero_reduce_scatter", "zero_overlap_comm", "zero_contiguous_gradients", "zero_allgather_partitions",
           "zero_sub_group_size", "zero_prefetch_bucket_size", "zero_param_persistence_threshold",
           "zero_model_persistence_threshold", "zero_max_live_parameters", "zero_max_reuse_distance",
           "zero_gather_16bit_weights_on_model_save", "zero_load_from_fp32_weights", "zero_elastic_checkpoint",
           "zero_ignore_unused_parameters", "zero_round_robin_gradients", "zero_hpz_partition_size",
           "zero_compute_grad_norm", "zero_parameter_alignment", "zero_legacy_stage1", "zero_quantized_weights",
           "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zero_partial_offload",
           "zero_multi_rank_bucket_allreduce", "zero_allgather_sequential", "zero_module_granularity_threshold",
           "zero_log_trace_cache_warnings", "initial_dynamic_scale", "fp16_auto_cast",
           "get_data_parallel_rank", "get_model_parallel_rank", "get_tensor_parallel_rank")
# Methods whose result is an object: compared through what scripts read of it.
OBJECT_METHODS = {"zero_offload_optimizer": lambda v: None if v is None else str(getattr(v.device, "value", v.device)),
                  "zero_offload_param": lambda v: None if v is None else str(getattr(v.device, "value", v.device))}
PIPELINE_ATTRIBUTES = ("stage_id", "num_stages", "prev_stage", "next_stage", "micro_batches", "micro_batch_size",
                       "is_pipe_parallel", "is_data_parallel", "is_model_parallel", "grid")
PIPELINE_METHODS = ("is_first_stage", "is_last_stage", "is_gradient_accumulation_boundary", "get_mom")
GRID_GETTERS = ("get_stage_id", "get_global_rank", "get_pipe_parallel_rank", "get_pipe_parallel_world_size",
                "get_data_parallel_rank", "get_data_parallel_world_size", "get_model_parallel_rank",
                "get_model_parallel_world_size", "get_slice_parallel_rank", "get_slice_parallel_world_size",
                "get_data_parallel_group_ranks")
GRID_ATTRIBUTES = ("stage_id", "data_parallel_id", "pipe_parallel_size", "data_parallel_size",
                   "model_parallel_size", "slice_parallel_size", "is_first_stage", "is_last_stage", "pp_group",
                   "dp_group", "world_size", "global_rank")


def _plain(value: Any) -> Any:
    """A value as compared: tuples as lists, torch dtypes and devices as strings."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"<{type(value).__name__}>"


def _runtime(ds, path: str) -> Any:
    """`ds.runtime.<path>`, DeepSpeed's module path of its engine classes."""
    return importlib.import_module(f"{ds.__name__}.runtime.{path}")


def _kind(obj: Any, name: str) -> str:
    try:
        value = getattr(obj, name)
    except AttributeError:
        return "missing"
    return "method" if inspect.ismethod(value) else "attribute"


def _read(obj: Any, attributes: tuple[str, ...], methods: tuple[str, ...]) -> dict[str, tuple[str, Any]]:
    """name -> (kind, value): the attribute's value or the method called without arguments."""
    out = {}
    for name in attributes + methods:
        kind = _kind(obj, name)
        value = getattr(obj, name) if kind != "missing" else None
        if kind == "method" and name in methods:
            try:
                value = value()
            except Exception as e:      # DeepSpeed's getters of groups it did not build assert
                value = f"raises {type(e).__name__}"
        out[name] = (kind, value)
    return out


def _facts(ds, engine, model: torch.nn.Module) -> dict[str, Any]:
    facts = {name: (kind, _plain(value)) for name, (kind, value) in _read(engine, ATTRIBUTES, METHODS).items()}
    for name, show in OBJECT_METHODS.items():
        kind = _kind(engine, name)
        facts[name] = (kind, show(getattr(engine, name)()) if kind == "method" else None)
    facts["isinstance DeepSpeedEngine"] = (isinstance(engine, ds.DeepSpeedEngine),
                                           isinstance(engine, _runtime(ds, "engine").DeepSpeedEngine))
    facts["isinstance PipelineEngine"] = (isinstance(engine, ds.PipelineEngine),
                                          isinstance(engine, _runtime(ds, "pipe.engine").PipelineEngine))
    # a process group over the data-parallel ranks (here the world)
    group = engine.data_parallel_group
    facts["data_parallel_group"] = (_kind(engine, "data_parallel_group"), torch.distributed.get_world_size(group),
                                    torch.distributed.get_rank(group))
    facts["module is the model"] = engine.module is model
    facts["optimizer has param_groups"] = _kind(engine, "optimizer") == "attribute" and \
        len(engine.optimizer.param_groups) >= 1
    # what Accelerate's step_was_skipped and scripts read of DeepSpeed's optimizer wrapper
    facts["optimizer overflow, cur_scale, loss_scale"] = [_plain(getattr(engine.optimizer, name, "missing"))
                                                          for name in ("overflow", "cur_scale", "loss_scale")]
    facts["lr_scheduler"] = (_kind(engine, "lr_scheduler"), type(engine.lr_scheduler).__name__)
    # Hugging Face's Trainer reads the config dict this way before saving
    facts["config lookups"] = (engine.config.get("zero_optimization", {}).get("stage"),
                               engine.config["train_batch_size"], "optimizer" in engine.config,
                               engine.config.get("absent", "default"))
    # an nn.Module whose child is the model: names start with "module."
    # The model's mode follows engine.eval() / train(). (Here they are nn.Module's: they return the engine and set
    # engine.training too; DeepSpeed's return None and leave engine.training as it was.)
    training = [engine.training]
    engine.eval()
    training.append(model.training)
    engine.train()
    training.append(model.training)
    facts["nn.Module"] = (isinstance(engine, torch.nn.Module), next(iter(engine.named_parameters()))[0],
                          sorted(engine.state_dict())[:2], training)
    # a member the engine lacks is the module's (DeepSpeed's __getattr__)
    facts["module member through the engine"] = engine.pipeline_layers.__func__ is type(model).pipeline_layers
    return facts


def _accelerate_steps(engine, batches: list[torch.Tensor]) -> list[float]:
    """Accelerate's loop: the boundary set before every backward; step() on the boundary only (Accelerate today),
    then after every backward (Accelerate before), one global batch each."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    gas = engine.gradient_accumulation_steps()
    losses = []
    for step_every_backward, batch in zip((False, True), batches):
        for k, rows in enumerate(shard_global_batch(batch, dp_size=world, dp_rank=rank, grad_accum=gas)):
            boundary = k == gas - 1
            engine.set_gradient_accumulation_boundary(boundary)
            loss = engine(rows[:, :-1], rows[:, 1:])
            engine.backward(loss)
            losses.append(float(loss.detach()))
            if boundary or step_every_backward:
                engine.step()
    return losses


def _checkpoint_members(engine, model: torch.nn.Module, zero3: bool) -> dict[str, Any]:
    """save_fp16_model, module_state_dict and load_module_state_dict: kinds, what they return, what they write
    or load. The load is checked where the module holds whole tensors (DeepSpeed's ZeRO-3 loads into its empty
    placeholders unless told to gather)."""
    import os
    import tempfile
    import torch.distributed as dist
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    saved = engine.save_fp16_model(box[0], save_filename="weights.bin")
    dist.barrier()
    written = torch.load(os.path.join(box[0], "weights.bin"), weights_only=True)
    facts: dict[str, Any] = {
        "save_fp16_model": (_kind(engine, "save_fp16_model"), saved,
                            sorted((k, list(v.shape), str(v.dtype)) for k, v in written.items())),
    }
    state = engine.module_state_dict()
    first = next(iter(model.parameters()))
    first.requires_grad_(False)
    unfrozen = engine.module_state_dict(exclude_frozen_parameters=True)
    first.requires_grad_(True)
    facts["module_state_dict"] = (_kind(engine, "module_state_dict"), sorted(state), sorted(set(state) - set(unfrozen)),
                                  sorted(set(model.state_dict()) ^ set(state)))
    loaded: Any = None
    if not zero3:
        shifted = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
        returned = engine.load_module_state_dict({"module": shifted})
        loaded = (returned, all(torch.equal(v, shifted[k]) for k, v in model.state_dict().items()))
    facts["load_module_state_dict"] = (_kind(engine, "load_module_state_dict"), loaded)
    return facts


def _engine_script(ds, config: dict) -> dict:
    model = tiny_gpt(seq_len=SEQ)
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))
    batches = token_batches(2, 8, SEQ + 1, seed=5)
    losses = _accelerate_steps(engine, batches)
    facts = _facts(ds, engine, model)
    facts.update(_checkpoint_members(engine, model, zero3=config["zero_optimization"]["stage"] == 3))
    engine.set_train_micro_batch_size(4)       # the accumulation stays: the global batch doubles
    facts["after set_train_micro_batch_size(4)"] = [engine.train_batch_size(),
                                                    engine.train_micro_batch_size_per_gpu(),
                                                    engine.gradient_accumulation_steps()]
    engine.destroy()
    return {"facts": facts, "losses": losses}


def _pipeline_script(ds) -> dict:
    from torch import nn
    twin = tiny_gpt(seq_len=SEQ, tie_embeddings=False)     # a weight on two stages needs DeepSpeed's TiedLayerSpec
    blocks = list(twin.blocks)
    layers = [nn.Sequential(twin.embed, blocks[0]), nn.Sequential(blocks[1], twin.head)]
    net = ds.pipe.PipelineModule(layers=layers, loss_fn=twin.loss, num_stages=2, partition_method="uniform")
    engine, *_ = ds.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                               config=copy.deepcopy(PIPE))
    rows = token_batches(1, 2 * 2, SEQ + 1, seed=9)[0]
    micro = [(r[:, :-1], r[:, 1:]) for r in rows.split(2)]
    loss = float(engine.train_batch(iter(micro)))
    # a loader of another shape, read without an iterator through set_dataloader, made pairs by set_batch_fn
    engine.set_dataloader([{"rows": r} for r in rows.split(2)])
    engine.set_batch_fn(lambda batch: (batch["rows"][:, :-1], batch["rows"][:, 1:]))
    loaded_loss = float(engine.train_batch())
    eval_loss = float(engine.eval_batch(iter([{"rows": r} for r in rows.split(2)])))
    facts = {name: (kind, value) for name, (kind, value) in
             _read(engine, PIPELINE_ATTRIBUTES + ("dp_world_size", "mp_world_size"), PIPELINE_METHODS).items()
             if name != "grid"}
    facts["grid kind"] = _kind(engine, "grid")
    grid = engine.grid
    facts["grid"] = {name: _plain(getattr(grid, name)()) for name in GRID_GETTERS}
    facts["grid attributes"] = {name: _plain(getattr(grid, name)) for name in GRID_ATTRIBUTES}
    facts["isinstance PipelineEngine"] = (isinstance(engine, ds.PipelineEngine),
                                          isinstance(engine, _runtime(ds, "pipe.engine").PipelineEngine))
    facts["isinstance DeepSpeedEngine"] = isinstance(engine, ds.DeepSpeedEngine)
    facts = {k: _plain(v) for k, v in facts.items()}
    engine.destroy()
    return {"facts": facts, "loss": loss, "loaded_loss": loaded_loss, "eval_loss": eval_loss}


def _ranks() -> dict:
    torch.set_num_threads(1)
    import shardwise
    out: dict[str, dict] = {"shardwise": {}, "deepspeed": {}}
    deepspeed = _import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")       # joins the group already there
    linear = torch.nn.functional.linear
    for side, ds in (("shardwise", shardwise), ("deepspeed", deepspeed)):
        try:
            out[side]["zero1"] = _engine_script(ds, ZERO1)
            out[side]["zero3"] = _engine_script(ds, ZERO3)
            out[side]["pipeline"] = _pipeline_script(ds)
        finally:
            torch.nn.functional.linear = linear           # DeepSpeed's ZeRO-3 leaves its own in place
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_ranks, WORLD, timeout=400)


def _answered_here(rank: int) -> dict[str, tuple[tuple[str, Any], tuple[str, Any]]]:
    """Where DeepSpeed 0.19 gives no usable value and shardwise does: name -> (DeepSpeed's, shardwise's). The
    parallel ranks (at dp 2) assert in DeepSpeed's engine without a model-parallel unit (`mpu`) that built its
    groups, and its get_batch_info returns the three getters themselves, uncalled."""
    return {"get_data_parallel_rank": (("method", "raises AssertionError"), ("method", rank)),
            "get_model_parallel_rank": (("method", "raises AssertionError"), ("method", 0)),
            "get_tensor_parallel_rank": (("method", "raises AssertionError"), ("method", 0)),
            "get_batch_info": (("method", ["<method>"] * 3), ("method", [8, 2, 2]))}


@pytest.mark.parametrize("script", ["zero1", "zero3"])
def test_engine_members_have_deepspeeds_kinds_and_values(results: list[dict], script: str) -> None:
    for rank, res in enumerate(results):
        ours, theirs = res["shardwise"][script]["facts"], res["deepspeed"][script]["facts"]
        assert ours.keys() == theirs.keys()
        answered = _answered_here(rank)
        for name, (deepspeeds, shardwises) in answered.items():
            assert (theirs[name], ours[name]) == (deepspeeds, shardwises), name
        differ = {name: (ours[name], theirs[name]) for name in theirs
                  if name not in answered and ours[name] != theirs[name]}
        assert not differ, f"{script} rank {rank}: (shardwise, DeepSpeed) differ: {differ}"
        assert all(theirs[name][0] == "attribute" for name in ATTRIBUTES)
        assert all(theirs[name][0] == "method" for name in METHODS)


def test_the_scripts_ran_what_they_check(results: list[dict]) -> None:
    facts = results[1]["shardwise"]["zero1"]["facts"]
    assert facts["global_rank"] == ("attribute", 1) and facts["world_size"] == ("attribute", 2)
    assert facts["global_steps"] == ("attribute", 2) and facts["micro_steps"] == ("attribute", 3)
    assert facts["get_mom"] == ("method", [[0.9, 0.95]]) and facts["gradient_clipping"] == ("method", 0.5)
    assert facts["after set_train_micro_batch_size(4)"] == [16, 4, 2]
    assert facts["zero_optimization"] == ("method", True) and facts["isinstance DeepSpeedEngine"] == (True, True)
    zero3 = results[0]["shardwise"]["zero3"]["facts"]
    assert zero3["zero_offload_optimizer"] == ("method", "cpu") and zero3["zero_cpu_offload"] == ("method", True)
    assert zero3["zero_gather_16bit_weights_on_model_save"] == ("method", True)
    for written in (facts, zero3):          # the whole model, in fp32 here
        assert written["save_fp16_model"][:2] == ("method", True) and len(written["save_fp16_model"][2]) > 5
        assert {dtype for *_, dtype in written["save_fp16_model"][2]} == {"torch.float32"}
    assert facts["module_state_dict"][0] == "method" and facts["module_state_dict"][2] == ["embed.tok.weight"]
    assert facts["load_module_state_dict"] == ("method", (None, True))
    assert facts["optimizer overflow, cur_scale, loss_scale"] == [False, 1.0, 1.0]


@pytest.mark.parametrize("script", ["zero1", "zero3"])
def test_accelerate_style_boundary_trains_as_deepspeed(results: list[dict], script: str) -> None:
    for rank, res in enumerate(results):
        assert_close_lists(res["shardwise"][script]["losses"], res["deepspeed"][script]["losses"], rtol=1e-5,
                           what=f"{script} rank {rank} losses")


def test_pipeline_engine_members_match_deepspeed(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        ours, theirs = res["shardwise"]["pipeline"]["facts"], res["deepspeed"]["pipeline"]["facts"]
        differ = {name: (ours.get(name), theirs[name]) for name in theirs if ours.get(name) != theirs[name]}
        assert not differ, f"rank {rank}: (shardwise, DeepSpeed) differ: {differ}"
        assert ours["stage_id"] == ["attribute", rank] and ours["is_first_stage"] == ["method", rank == 0]
        assert ours["isinstance PipelineEngine"] == [True, True] and ours["grid kind"] == "attribute"
        losses = {side: [res[side]["pipeline"][k] for k in ("loss", "loaded_loss", "eval_loss")]
                  for side in ("shardwise", "deepspeed")}
        assert_close_lists(losses["shardwise"], losses["deepspeed"], rtol=1e-5, what=f"rank {rank} pipeline losses")
        assert losses["shardwise"][1] != losses["shardwise"][0]     # the second step trained on updated weights
