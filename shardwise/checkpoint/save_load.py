"""`engine.save_checkpoint` / `engine.load_checkpoint` over every layout the engine runs. Files of one tag
(`files.py` writes them, atomically and collectively):

    mp_rank_MM_model_states.pt                  module, optimizer (stage 0), scheduler, counters, config, client
                                                state, DeepSpeed's metadata (ZeRO-3: one per dp rank D,
                                                zero_pp_rank_D_mp_rank_MM_model_states.pt)
    zero_pp_rank_D_mp_rank_MM_optim_states.pt   ZeRO: the optimizer shard of data-parallel rank D, ours and
                                                DeepSpeed's partition (`deepspeed_write.py`)
    layer_XX-model_states.pt                    a pipeline of layers: each layer's module states
    layer_L_expert_E_mp_rank_MM_model_states.pt an MoE model: one expert's module states, and without ZeRO
    expp_rank_R_mp_rank_MM_optim_states.pt      ep rank R's optimizer (`experts.py`)
    shardwise_index.pt                          where every tensor of the full model lives (`index.py`)

DeepSpeed's load_checkpoint and zero_to_fp32.py read these tags; `load` reads DeepSpeed's (`deepspeed_read.py`).

Nothing here asks which strategy runs: the mesh gives the layout, the context's `naming` names a stage's tensors,
its `state` and `dp_runtime` give their state.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint import deepspeed_read, deepspeed_write
from shardwise.checkpoint import index as checkpoint_index
from shardwise.checkpoint import reshard
from shardwise.checkpoint.context import CheckpointContext
from shardwise.checkpoint.experts import expert_files
from shardwise.comm.collectives import Comm
from shardwise.comm.topology import Axis
from shardwise.errors import ArgumentError, TagValidationError, UserError
from shardwise.parallel.tensor_parallel.state_dict import gather_full_state_dict

_SPANNING = (Axis.DP, Axis.TP, Axis.PP)
RESERVED_KEYS = frozenset({"micro_steps", "pp_world_size", "client_state", "shardwise_optimizer",
                           "shardwise_version"})
"""Our own keys of the model states, beside DeepSpeed's (`deepspeed_read.STATE_KEYS`): not client state."""


def _comms(ctx: CheckpointContext) -> list[Comm]:
    """The groups whose successive barriers span the whole mesh: dp (the stage's), tp, pp. A save's barrier and
    failure agreement run over them in turn: after the three, every rank of the mesh has arrived (or heard of a
    failure). An axis of size 1 gives a comm whose collectives are no-ops."""
    return [ctx.comm(axis) for axis in _SPANNING]


def layout(ctx: CheckpointContext) -> dict[str, int]:
    """This rank's place: tp rank/size, pp stage/size, and the model-parallel rank naming its files (MM in
    `mp_rank_MM_*`: pp_stage * tp + tp_rank, as in DeepSpeed's grid; 00 without model parallelism)."""
    mesh = ctx.mesh
    tp_rank, tp_size = mesh.rank(Axis.TP), mesh.size(Axis.TP)
    pp_stage, pp_size = mesh.rank(Axis.PP), mesh.size(Axis.PP)
    return {"tp_rank": tp_rank, "tp_size": tp_size, "pp_stage": pp_stage, "pp_size": pp_size,
            "mp_rank": pp_stage * tp_size + tp_rank}


def model_states_file(ctx: CheckpointContext, mp_rank: int, dp_rank: int = 0) -> str:
    """The model-states file of (model-parallel rank, dp rank): DeepSpeed's names, one per model-parallel rank,
    or at ZeRO-3 one per (dp rank, model-parallel rank)."""
    if ctx.zero_stage == 3:
        return ckpt.zero3_model_states_name(dp_rank, mp_rank)
    return ckpt.model_states_name(mp_rank)


def _refuse_expert_parallel(ctx: CheckpointContext, what: str) -> None:
    """The consolidated weights are gathered over dp, where experts differ between ranks: refused on every rank
    alike (checkpoints keep each expert in its own file: `experts.py`)."""
    from shardwise.parallel.replicas import replicas_of
    if any(replicas_of(p) is not None for p in ctx.module.parameters()):
        raise UserError(f"{what} of a model with expert-parallel parameters (an MoE layer with ep_size > 1) is not "
                        f"supported yet: each rank holds other experts; save a checkpoint (engine.save_checkpoint), "
                        f"which keeps every expert, or train with ep_size = 1")


def save(ctx: CheckpointContext, save_dir: str, tag: str | None, client_state: dict[str, Any] | None, *,
         save_latest: bool = True, exclude_frozen: bool = False) -> bool:
    """Write one tag in DeepSpeed's files and keys, plus our index. Model states come from the ranks of
    data-parallel index 0 (one per (stage, TP rank); at ZeRO-3 from every rank, as DeepSpeed's), keyed by the
    full model's names ("blocks.3.attn.q_proj.weight"), the client state's keys at their top level; ZeRO shards
    from every rank (ours, and DeepSpeed's partition of the same state: `deepspeed_write.py`); the index from
    world rank 0. Collective over the mesh."""
    if not save_dir:
        raise ArgumentError(f"save_checkpoint: save_dir is {save_dir!r}; give the directory to write the checkpoint "
                        f"into")
    tag = _agreed_tag(ctx, f"global_step{ctx.progress.global_steps}" if tag is None else str(tag))
    client = dict(client_state or {})
    clash = sorted(set(client) & (deepspeed_read.STATE_KEYS | RESERVED_KEYS))
    if clash:
        raise UserError(f"save_checkpoint: client_state key {clash[0]!r} is one the checkpoint keeps for itself "
                        f"(DeepSpeed's and ours: {sorted(deepspeed_read.STATE_KEYS | RESERVED_KEYS)}); rename it")
    where = layout(ctx)
    per_rank = ctx.state.checkpoint_per_rank
    native = ctx.state.state_dict()
    groups = deepspeed_write.flat_groups(ctx)
    files: dict[str, Any] = {}
    experts = expert_files(ctx, where["mp_rank"])
    names = ctx.naming.full_names(ctx.module)
    expert_names = {names[k]: f for k, f in experts.files.items()}
    if experts.writer and ctx.zero_stage != 3:   # ZeRO-3's values are its masters (the optimizer files)
        module = ctx.naming.module_state_dict(ctx.module)
        for name, file in expert_names.items():
            files.setdefault(file, {})[name] = module[name]
    if experts.writer and experts.optim_file is not None:
        # Without ZeRO: this ep rank's optimizer, whose expert entries the index points at (the fp32 values of
        # what it steps in place are its "module").
        files[experts.optim_file] = {"optimizer": deepspeed_write.stage0_optimizer(ctx, native),
                                     checkpoint_index.NATIVE_STAGE0_KEY: native,
                                     "module": {n: v for n, v in ctx.naming.module_state_dict(ctx.module).items()
                                                if n in expert_names},
                                     "ds_config": ctx.raw_config}
    if ctx.dp_rank == 0 or ctx.zero_stage == 3:       # one writer per (stage, TP rank); at ZeRO-3 every rank
        module = ctx.naming.module_state_dict(ctx.module)
        if ctx.zero_stage != 3:         # the experts are in their own files
            module = type(module)((k, v) for k, v in module.items() if k not in expert_names)
        frozen = {names[n] for n, p in ctx.module.named_parameters() if not p.requires_grad}
        if exclude_frozen:
            module = type(module)((k, v) for k, v in module.items() if k not in frozen)
        if ctx.zero_stage == 3:
            # DeepSpeed's ZeRO-3 module states: every trained parameter an empty placeholder (also the persistent
            # ones we hold whole); the values are the optimizer files' masters.
            trained = {names[n] for n, p in ctx.module.named_parameters(remove_duplicate=False) if p.requires_grad}
            module = type(module)((k, v.new_empty(0) if k in trained else v) for k, v in module.items())
        layers = checkpoint_index.per_layer(ctx, where)
        if layers:          # DeepSpeed's PipelineModule: a file per layer, under the layer's own names
            for name, value in module.items():
                file, key = ckpt.layer_file_of(name)  # type: ignore[misc]
                files.setdefault(file, {})[key] = value
        files[model_states_file(ctx, where["mp_rank"], ctx.dp_rank)] = {
            "module": None if layers else module,
            **deepspeed_write.model_state_keys(ctx, groups, zero_stage=ctx.zero_stage, exclude_frozen=exclude_frozen,
                                               strip=deepspeed_read.PIPELINE_PREFIX if layers else ""),
            # Stage 0: torch's optimizer state dict (in bf16 / fp16 inside DeepSpeed's wrapper's) is DeepSpeed's
            # "optimizer"; ours holds it with the masters and the loss scaler (pickled once: the same objects).
            "optimizer": None if per_rank else deepspeed_write.stage0_optimizer(ctx, native),
            "shardwise_optimizer": None if per_rank else native,
            "lr_scheduler": deepspeed_write.scheduler_state(ctx.lr_scheduler) if ctx.lr_scheduler is not None
            else None,
            "global_steps": ctx.progress.global_steps, "global_samples": ctx.progress.global_samples,
            "skipped_steps": ctx.progress.skipped_steps, "micro_steps": ctx.progress.micro_steps,
            # DeepSpeed's PipelineEngine counts every stage's model-states file as model parallel; its engine with
            # a Megatron mpu only the TP ranks.
            "dp_world_size": ctx.dp_size, "pp_world_size": where["pp_size"],
            "mp_world_size": where["tp_size"] * (where["pp_size"] if layers else 1),
            "checkpoint_parallel_dimensions": {"pp_degree": where["pp_size"], "tp_degree": where["tp_size"]},
            "ds_config": ctx.raw_config,
            **client,
        }
    optim_file = ckpt.optim_states_name(ctx.dp_rank, where["mp_rank"], bf16=ctx.bf16)
    if per_rank:
        files[optim_file] = {ckpt.NATIVE_OPTIMIZER_STATE_DICT: native, "ds_config": ctx.raw_config,
                             "ds_version": deepspeed_write.DEEPSPEED_VERSION}
    # Every rank gets the index: the second phase reads the staged shards through it.
    mine = checkpoint_index.rank_contribution(ctx, where, exclude_frozen=exclude_frozen)
    index = checkpoint_index.gather_index(ctx, mine, everywhere=True)
    assert index is not None
    then = None
    # DeepSpeed's partitions of an MoE model are laid out per expert group: not written (ours reload any layout).
    if per_rank and where["tp_size"] == 1 and not experts:
        def then(staging: Path) -> dict[str, Any]:
            """DeepSpeed's partition of this rank, read from every rank's staged shard (written moments ago by
            this save, whose index, with their sums, is written after this pass: nothing to check them against)."""
            theirs = deepspeed_write.zero_optimizer_state(
                ctx, index, reshard.FileReader(staging, sums={}), groups, zero_stage=ctx.zero_stage,
                clip=float(ctx.raw_config.get("gradient_clipping", 1.0)), scaler=native["scaler"])
            return {optim_file: {**files[optim_file], ckpt.OPTIMIZER_STATE_DICT: theirs}}

    def barrier() -> None:
        for c in _comms(ctx):
            c.barrier()

    # World rank 0 writes the index last, with the size and CRC-32 of every file every rank wrote, the DeepSpeed
    # partitions of the second pass included (`index.sealer`).
    # Each rank also sums the pieces of its files the index maps, from the written files (`reshard.piece_sums`).
    staging = ckpt.staging_dir(save_dir, tag)
    ckpt.write_tag(save_dir, tag, files, rank=dist.get_rank(), barrier=barrier,
                   any_failed=lambda failed: _any_failed(ctx, failed), save_latest=save_latest, then=then,
                   seal=checkpoint_index.sealer(ctx, index, lambda names: reshard.piece_sums(index, staging, names)))
    return True


def _agreed_tag(ctx: CheckpointContext, tag: str) -> str:
    """The tag every rank saves under: DeepSpeed's checkpoint.tag_validation compares the ranks' tags ("Fail":
    one `UserError` line on every rank; "Warn": one warning line; "Ignore": none). A save is written by all ranks
    into one directory, so with "Warn" and "Ignore" the ranks then use world rank 0's tag (DeepSpeed would scatter
    the files over several directories, none of them loadable)."""
    tags = [tag]
    for c in _comms(ctx):
        tags = [t for part in c.all_gather_object(tags) for t in part]
    # After dp, tp and pp in turn, every rank holds every rank's tag, world rank 0's first.
    if len(set(tags)) == 1:
        return tag
    mode = ctx.tag_validation.upper()
    line = (f"save_checkpoint: the ranks save under different tags ({sorted(set(tags))[:4]}): a tag with "
            f"rank-specific parts cannot be restored at another world size; give every rank the same tag")
    if mode == "FAIL":
        raise TagValidationError(line + ' (checkpoint.tag_validation = "Fail")')
    if mode == "WARN":
        warnings.warn(f"{line}; saving under world rank 0's tag {tags[0]!r}", ckpt.CheckpointWarning,
                      stacklevel=4)
    return tags[0]


def _any_failed(ctx: CheckpointContext, failed: bool) -> bool:
    """Whether any rank of the mesh failed (the flag's max over dp, tp, pp in turn): every rank learns it."""
    flag = float(failed)
    for c in _comms(ctx):
        flag = c.all_reduce_object_max(flag)
    return flag > 0


def load(ctx: CheckpointContext, load_dir: str, tag: str | None, *, strict: bool, load_optimizer_states: bool,
         load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str | None, dict[str, Any] | None]:
    """Check everything, agree on it, then change the run: a checkpoint that cannot be loaded raises the
    same one line on every rank and leaves the module, the optimizer and the counters as they were.

    With the index a tag loads at any (dp, tp, pp, ZeRO stage, offload), optimizer states included
    (`reshard.py`); a tag written before indexes loads at the layout that wrote it (weights also at another
    number of stages with `load_module_only=True`)."""
    path = ckpt.resolve_tag(load_dir, tag)
    if path is None:
        return None, None
    read: reshard.FileReader = reshard.FileReader(path)
    plan: reshard.Plan | None = None
    own: dict[str, Any] | None = None
    problem: str | None = None
    same = False
    foreign = False
    try:
        index = checkpoint_index.read_index(path)
        if index is None and deepspeed_read.written_by_deepspeed(read(read.head)):
            # DeepSpeed wrote it: its own metadata gives the index, its files are read through our view.
            read, foreign = deepspeed_read.DeepSpeedReader(path), True
            index = deepspeed_read.deepspeed_index(read)
    except ckpt.CheckpointError as e:
        index, problem = None, str(e)
    else:
        try:
            if index is not None:
                plan = reshard.Plan(ctx, index, read, strict=strict, optimizer=not load_module_only)
                problem = plan.problem
                # At the layout that wrote it (and with the optimizer) a rank reads its own files as they are.
                mine = checkpoint_index.rank_contribution(ctx, layout(ctx), as_writer=True)
                same = not foreign and not load_module_only and checkpoint_index.same_layout(index, mine)
                # Experts live in files of their own, not in a rank's: always read through the index.
                same = same and not expert_files(ctx, layout(ctx)["mp_rank"])
            if index is None or (same and problem is None):
                # Read whole, as before indexes: what it returns becomes the optimizer's state.
                own = _read_own(ctx, path, reshard.FileReader(path, mmap=False), load_module_only,
                                indexed=index is not None)
                # The same pieces in another state format (ZeRO-2's buckets read at ZeRO-3, whose units hold
                # the same elements): the index reshards it; without an index it is refused before any change.
                mismatch = None if load_module_only else ctx.state.state_dict_mismatch(own["optimizer"])
                if mismatch is not None:
                    if index is None:
                        raise ckpt.CheckpointError(mismatch)
                    same, own = False, None
            if plan is not None and problem is None and not same:
                # Resharding reads only pieces of the files: each is checked against its CRC-32 before any
                # change (at the writer's layout the files are read, and checked, whole).
                problem = plan.check_reads()
        except ckpt.CheckpointError as e:
            problem = str(e)
    same = reshard.agree(ctx, problem, same_layout=same)
    if plan is not None and not same:
        reshard.apply(plan, load_optimizer_states=load_optimizer_states)
    else:
        assert own is not None
        ctx.naming.load_module_state(ctx.module, own["module"], strict)
        if not load_module_only:
            ctx.state.load_state_dict(own["optimizer"], load_optimizer_states=load_optimizer_states)
    state = read(read.head)
    if load_module_only:
        ctx.state.sync_masters_from_model()
    else:
        if load_lr_scheduler_states and ctx.lr_scheduler is not None and state["lr_scheduler"] is not None:
            load_scheduler_state(ctx.lr_scheduler, state["lr_scheduler"])
        ctx.progress.resume(global_steps=state["global_steps"],
                            global_samples=state.get("global_samples", 0),
                            skipped_steps=state["skipped_steps"])
    ctx.dp_runtime.zero_grad()
    return str(path), saved_client_state(state)


def saved_client_state(state: dict[str, Any]) -> dict[str, Any]:
    """The client state a tag holds: top-level keys of the model states other than the engine's (DeepSpeed's
    place for it, and ours), or the `client_state` entry of a tag written by an earlier shardwise. A copy: its
    tensors out of the mapped file."""
    if "client_state" in state and "buffer_names" not in state:
        return copy.deepcopy(state["client_state"])
    return copy.deepcopy(deepspeed_read.client_state(state, RESERVED_KEYS))


def load_scheduler_state(scheduler: Any, saved: dict[str, Any]) -> None:
    """Restore the lr scheduler from its saved state: ours, or DeepSpeed's schedules' {"last_batch_iteration":
    it}, which our closed-form schedules (the same lr at every iteration) take as last_epoch = it + 1."""
    if "last_epoch" not in saved and "last_batch_iteration" in saved and hasattr(scheduler, "_lrs_at"):
        it = int(saved["last_batch_iteration"])
        scheduler.last_epoch, scheduler._step_count = it + 1, it + 2
        scheduler._last_lr = list(scheduler._lrs_at(it))
        return
    scheduler.load_state_dict(saved)


def _read_own(ctx: CheckpointContext, path: Path, read: reshard.FileReader, load_module_only: bool, *,
              indexed: bool) -> dict[str, Any]:
    """This rank's own files, at the layout that wrote them: an indexed checkpoint found at it, or one written
    without an index (an earlier shardwise), which loads only there (weights also at another number of
    stages), checked here before anything changes."""
    where = layout(ctx)
    own = ckpt.model_states_file(path, where["mp_rank"]).name
    state = read(own if indexed or (path / own).is_file() else ckpt.model_states_name(where["tp_rank"]))
    tp_saved = (state.get("checkpoint_parallel_dimensions") or {}).get("tp_degree", state.get("mp_world_size", 1))
    saved = {"dp": state.get("dp_world_size", 1), "tp": tp_saved, "pp": state.get("pp_world_size", 1)}
    now = {"dp": ctx.dp_size, "tp": where["tp_size"], "pp": where["pp_size"]}
    per_rank = ctx.state.checkpoint_per_rank
    stage0 = state.get(checkpoint_index.NATIVE_STAGE0_KEY, state.get("optimizer"))
    differs = [k for k in ("tp", "pp", "dp") if saved[k] != now[k] and not (load_module_only and k != "tp")]
    if differs or (not load_module_only and (stage0 is None) != per_rank):
        raise ckpt.CheckpointError(
            f"{path} was written without a layout index (by an earlier shardwise) at dp={saved['dp']}, "
            f"tp={saved['tp']}, pp={saved['pp']} and ZeRO stage {'1-3' if stage0 is None else 0}; "
            f"it loads only at that layout: load it there and save it again to reshard it")
    if state["module"] is None:         # one file per pipeline layer (every stage's: each stage takes its own)
        module: dict[str, Any] = {}
        for file in sorted(f.name for f in path.iterdir() if ckpt.LAYER_FILE.fullmatch(f.name)):
            module.update(read(file)["module"])
    elif saved["pp"] != now["pp"]:
        module = {}
        mp = where["tp_rank"]
        while ckpt.model_states_file(path, mp).is_file():
            module.update(read(ckpt.model_states_file(path, mp).name)["module"])
            mp += saved["tp"]
    else:
        module = state["module"]
    # A ZeRO-3 placeholder of a parameter this rank holds whole (persistent): keep its tensor, which the
    # optimizer's masters then overwrite.
    own_state = ctx.module.state_dict()
    full = ctx.naming.full_names(ctx.module)
    for local, t in own_state.items():
        saved_t = module.get(full[local])
        if torch.is_tensor(saved_t) and saved_t.numel() == 0 and t.numel() > 0:
            module = {**module, full[local]: t}
    out = {"module": module}
    if not load_module_only:
        shard = ckpt.optim_states_name(ctx.dp_rank, where["mp_rank"], bf16=ctx.bf16)
        if not (path / shard).is_file():        # written before bf16 runs took DeepSpeed's "bf16_" prefix
            shard = ckpt.optim_states_name(ctx.dp_rank, where["mp_rank"])
        out["optimizer"] = ckpt.native_optimizer_state(read(shard)) if per_rank else stage0
    return out


def consolidated_state_dict(ctx: CheckpointContext, *, exclude_frozen: bool = False
                            ) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict under the single-process names, on world rank 0 (None elsewhere).
    Collective: every rank calls it. ZeRO-3 shards are gathered over dp, TP slices over tp, and the stages'
    layers collected over pp; one stage at a time never holds more than its own part plus the result."""
    # Only the ranks of dp index 0 assemble (then of tp index 0): every collective below runs within them.
    local = ctx.dp_runtime.gathered_state_dict(ctx.module, rank0_only=True)
    if local is None:
        return None
    tp_comm = ctx.comm(Axis.TP)
    local = gather_full_state_dict(ctx.module, tp_comm, local, copy=False)
    if tp_comm.rank != 0:
        return None
    if exclude_frozen:
        frozen = {n for n, p in ctx.module.named_parameters() if not p.requires_grad}
        local = {k: v for k, v in local.items() if k not in frozen}
    merged = ctx.naming.gather_stages(local)
    return merged if dist.get_rank() == 0 else None


def save_16bit_model(ctx: CheckpointContext, save_dir: str, save_filename: str, exclude_frozen: bool) -> bool:
    """DeepSpeed's `save_16bit_model`: the consolidated weights in the training dtype, one file written by world
    rank 0 (atomically: a temporary file renamed into place). Collective."""
    _refuse_expert_parallel(ctx, "save_16bit_model")
    state = consolidated_state_dict(ctx, exclude_frozen=exclude_frozen)
    failed = False
    if state is not None:
        try:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            ckpt.atomic_save({k: v.detach().cpu().clone() for k, v in state.items()}, Path(save_dir) / save_filename)
        except BaseException:       # noqa: BLE001 - reported to every rank below, then re-raised here
            failed = True
            raise
        finally:
            _agree(ctx, failed)
    else:
        _agree(ctx, False)
    return True


def _agree(ctx: CheckpointContext, failed: bool) -> None:
    if _any_failed(ctx, failed) and not failed:
        raise ckpt.CheckpointError("save_16bit_model failed on rank 0; nothing was written")
