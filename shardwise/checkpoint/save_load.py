"""`engine.save_checkpoint` / `engine.load_checkpoint` over every layout the engine runs. Files of one tag
(`files.py` writes them, atomically and collectively):

    mp_rank_MM_model_states.pt                  module, optimizer (stage 0), scheduler, counters, config
    zero_pp_rank_D_mp_rank_MM_optim_states.pt   ZeRO: the optimizer shard of data-parallel rank D
    shardwise_index.pt                          where every tensor of the full model lives (`index.py`)

Nothing here asks which strategy runs: the mesh gives the layout, the context's `naming` names a stage's tensors,
its `state` and `dp_runtime` give their state.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint import index as checkpoint_index
from shardwise.checkpoint import reshard
from shardwise.checkpoint.context import CheckpointContext
from shardwise.comm.collectives import Comm
from shardwise.comm.topology import Axis
from shardwise.parallel.tensor_parallel.state_dict import gather_full_state_dict

_SPANNING = (Axis.DP, Axis.TP, Axis.PP)


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


def save(ctx: CheckpointContext, save_dir: str, tag: str | None, client_state: dict[str, Any] | None, *,
         save_latest: bool = True) -> bool:
    """Write one tag. Model states come from the ranks of data-parallel index 0 (one per (stage, TP rank)), keyed
    by the full model's names ("blocks.3.attn.q_proj.weight"); ZeRO shards from every rank; the index from world
    rank 0. Collective over the mesh."""
    tag = f"global_step{ctx.progress.global_steps}" if tag is None else str(tag)
    where = layout(ctx)
    per_rank = ctx.state.checkpoint_per_rank
    files: dict[str, Any] = {}
    if ctx.dp_rank == 0:       # one writer per (stage, TP rank): its layers' slices
        files[ckpt.model_states_name(where["mp_rank"])] = {
            "module": ctx.naming.module_state_dict(ctx.module),
            "optimizer": None if per_rank else ctx.state.state_dict(),
            "lr_scheduler": ctx.lr_scheduler.state_dict() if ctx.lr_scheduler is not None else None,
            "global_steps": ctx.progress.global_steps, "global_samples": ctx.progress.global_samples,
            "skipped_steps": ctx.progress.skipped_steps, "micro_steps": ctx.progress.micro_steps,
            "dp_world_size": ctx.dp_size, "mp_world_size": where["tp_size"], "pp_world_size": where["pp_size"],
            "ds_config": ctx.raw_config,
            "client_state": dict(client_state or {}),
        }
    if per_rank:
        files[ckpt.optim_states_name(ctx.dp_rank, where["mp_rank"])] = {
            "optimizer_state_dict": ctx.state.state_dict()}

    def barrier() -> None:
        for c in _comms(ctx):
            c.barrier()

    index = checkpoint_index.gather_index(ctx, checkpoint_index.rank_contribution(ctx, where))
    # World rank 0 writes the index last, with every file's size and CRC-32 (`index.sealer`).
    ckpt.write_tag(save_dir, tag, files, rank=dist.get_rank(), barrier=barrier,
                   any_failed=lambda failed: _any_failed(ctx, failed), save_latest=save_latest,
                   seal=checkpoint_index.sealer(ctx, index))
    return True


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
    read = reshard.FileReader(path)
    plan: reshard.Plan | None = None
    own: dict[str, Any] | None = None
    problem: str | None = None
    same = False
    try:
        index = checkpoint_index.read_index(path)
    except ckpt.CheckpointError as e:
        index, problem = None, str(e)
    else:
        try:
            if index is not None:
                plan = reshard.Plan(ctx, index, read, strict=strict, optimizer=not load_module_only)
                problem = plan.problem
                # At the layout that wrote it (and with the optimizer) a rank reads its own files as they are.
                mine = checkpoint_index.rank_contribution(ctx, layout(ctx), as_writer=True)
                same = not load_module_only and checkpoint_index.same_layout(index, mine)
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
    state = read(ckpt.model_states_name(0))
    if load_module_only:
        ctx.state.sync_masters_from_model()
    else:
        if load_lr_scheduler_states and ctx.lr_scheduler is not None and state["lr_scheduler"] is not None:
            ctx.lr_scheduler.load_state_dict(state["lr_scheduler"])
        ctx.progress.resume(global_steps=state["global_steps"], global_samples=state["global_samples"],
                            skipped_steps=state["skipped_steps"])
    ctx.dp_runtime.zero_grad()
    return str(path), copy.deepcopy(state["client_state"])     # its tensors out of the mapped file


def _read_own(ctx: CheckpointContext, path: Path, read: reshard.FileReader, load_module_only: bool, *,
              indexed: bool) -> dict[str, Any]:
    """This rank's own files, at the layout that wrote them: an indexed checkpoint found at it, or one written
    without an index (an earlier shardwise), which loads only there (weights also at another number of
    stages), checked here before anything changes."""
    where = layout(ctx)
    own = ckpt.model_states_name(where["mp_rank"])
    state = read(own if indexed or (path / own).is_file() else ckpt.model_states_name(where["tp_rank"]))
    saved = {"dp": state.get("dp_world_size", 1), "tp": state.get("mp_world_size", 1),
             "pp": state.get("pp_world_size", 1)}
    now = {"dp": ctx.dp_size, "tp": where["tp_size"], "pp": where["pp_size"]}
    per_rank = ctx.state.checkpoint_per_rank
    differs = [k for k in ("tp", "pp", "dp") if saved[k] != now[k] and not (load_module_only and k != "tp")]
    if differs or (not load_module_only and (state["optimizer"] is None) != per_rank):
        raise ckpt.CheckpointError(
            f"{path} was written without a layout index (by an earlier shardwise) at dp={saved['dp']}, "
            f"tp={saved['tp']}, pp={saved['pp']} and ZeRO stage {'1-3' if state['optimizer'] is None else 0}; "
            f"it loads only at that layout: load it there and save it again to reshard it")
    if saved["pp"] != now["pp"]:
        module: dict[str, Any] = {}
        mp = where["tp_rank"]
        while (path / ckpt.model_states_name(mp)).is_file():
            module.update(read(ckpt.model_states_name(mp))["module"])
            mp += saved["tp"]
    else:
        module = state["module"]
    out = {"module": module}
    if not load_module_only:
        out["optimizer"] = (read(ckpt.optim_states_name(ctx.dp_rank, where["mp_rank"]))["optimizer_state_dict"]
                            if per_rank else state["optimizer"])
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
