"""A checkpoint's whole model on one process, from the files of any layout: what `engine.save_16bit_model` assembles
with the ranks that trained (ZeRO-3 shards gathered, TP slices joined, pipeline stages merged), read here from the
files alone. `shardwise eval`, `generate` and `export` load models through it.

    state = consolidated_state_dict("runs/x/checkpoints", reference=model)   # single-process names -> tensors

What the files hold (`checkpoint.py`, `engine_checkpoint.py`): one `mp_rank_MM_model_states.pt` per (pipeline
stage, TP rank), MM = stage * tp + tp_rank, its module states under the full model's names; ZeRO stages 0-2 keep
whole (TP-sliced) weights there. ZeRO-3 keeps empty placeholders there and the weights in the per-rank optimizer
files as the fp32 master shards of each unit's flat buffer, in unit order; the unit plan is rebuilt from the
reference model with the run's persistence thresholds (`plan_units`, the code ZeRO-3 partitions with) and checked
against the flat sizes the files record before any value is used.

Only this module knows the file layout of a consolidation; a layout-independent index, when checkpoints carry
one, replaces the three readers below without changing the callers.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from shardwise import checkpoint as ckpt
from shardwise.errors import CheckpointError

CHECKPOINT_DIR = "checkpoints"


def resolve_checkpoint(path: str | Path) -> Path:
    """The tag directory meant by `path`: a run directory (its checkpoints' `latest`), a checkpoints directory
    (its `latest`), or a tag directory itself."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{str(p)!r}: no such run directory or checkpoint")
    if (p / ckpt.MODEL_STATES).is_file():
        return p
    if (p / CHECKPOINT_DIR).is_dir():
        p = p / CHECKPOINT_DIR
    tag = ckpt.resolve_tag(p, None)
    if tag is None:
        raise CheckpointError(f"{str(path)!r} holds no checkpoint (no 'latest' file or model states): train with "
                              f"--save-every N, or give the directory of one checkpoint tag")
    return tag


def consolidated_state_dict(path: str | Path, *, reference: nn.Module) -> dict[str, Tensor]:
    """The whole model's state dict (single-process names, the tensors as saved: training dtype) from the
    checkpoint at `path`. `reference` is the model it belongs to, at full size (its values are not read, a meta
    model does): it gives the full shapes to join TP slices and ZeRO-3's unit plan."""
    tag = resolve_checkpoint(path)
    head = ckpt.read_model_states(tag, 0)
    tp, pp = int(head.get("mp_world_size", 1)), int(head.get("pp_world_size", 1))
    full = reference.state_dict(keep_vars=True)
    per_tp = [_merge_stages(tag, tp_rank, tp, pp) for tp_rank in range(tp)]
    if any(t.numel() == 0 and full[k].numel() > 0 for k, t in per_tp[0].items() if k in full):
        if tp > 1 or pp > 1:
            raise CheckpointError(f"{tag}: a ZeRO-3 checkpoint written with tensor_parallel.size = {tp}, "
                                  f"pipeline.stages = {pp}: consolidating it needs the ranks that wrote it; "
                                  f"call engine.save_16bit_model at that layout")
        per_tp = [_fill_zero3(tag, head, per_tp[0], reference)]
    missing, unexpected = sorted(set(full) - set(per_tp[0])), sorted(set(per_tp[0]) - set(full))
    if missing or unexpected:
        example = f"no weights for {missing[0]}" if missing else f"weights for {unexpected[0]}, not in the model"
        raise CheckpointError(f"{tag} does not fit the model ({example}): it was written for another model; "
                              f"check --model / RUN_DIR/model.json")
    return {name: _join_tp(name, [s[name] for s in per_tp], full[name].shape) for name in full}


def _merge_stages(tag: Path, tp_rank: int, tp: int, pp: int) -> dict[str, Tensor]:
    """Every pipeline stage's module states of one TP rank, under the full model's names."""
    merged: dict[str, Tensor] = {}
    for stage in range(pp):
        merged.update(ckpt.read_model_states(tag, stage * tp + tp_rank)["module"])
    return merged


def _join_tp(name: str, slices: list[Tensor], shape: torch.Size) -> Tensor:
    """One tensor from its TP ranks' slices: replicated (every slice whole) or cut along the one dimension whose
    slice sizes add up to the full size."""
    first = slices[0]
    if tuple(first.shape) == tuple(shape):
        return first
    for dim in range(first.dim()):
        if sum(s.shape[dim] for s in slices) == shape[dim] and \
                all(s.shape[:dim] + s.shape[dim + 1:] == shape[:dim] + shape[dim + 1:] for s in slices):
            return torch.cat(slices, dim=dim)
    raise CheckpointError(f"checkpoint tensor {name!r} has shape {tuple(first.shape)} on TP rank 0 and the model "
                          f"{tuple(shape)}: it was written for another model; check --model / RUN_DIR/model.json")


def _zero3_thresholds(head: dict, world: int) -> tuple[int, int]:
    from shardwise.config import ConfigWarning, load_config_for_world
    raw = head.get("ds_config") or {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        cfg = load_config_for_world(copy.deepcopy(raw), world_size=world)
    return cfg.zero.stage3_param_persistence_threshold, cfg.zero.stage3_model_persistence_threshold


@torch.no_grad()
def _fill_zero3(tag: Path, head: dict, module: dict[str, Tensor], reference: nn.Module) -> dict[str, Tensor]:
    """ZeRO-3 (one pipeline stage, no TP): the placeholders of `module` filled from the dp ranks' master shards."""
    from shardwise.parallel.zero.params import plan_units
    from shardwise.parallel.zero.partition import FlatLayout
    dp = int(head.get("dp_world_size", 1))
    threshold, model_threshold = _zero3_thresholds(head, dp)
    plans, _ = plan_units(reference, persistence_threshold=threshold, model_persistence_threshold=model_threshold)
    shards = [ckpt.read_optim_states(tag, r, 0)["optimizer_state_dict"] for r in range(dp)]
    sizes = [[p.numel() for p in plan.params] for plan in plans]
    recorded = shards[0].get("flat_numels", [])
    if shards[0].get("zero_stage") != 3 or recorded[:len(sizes)] != [sum(s) for s in sizes] \
            or shards[0].get("masters") is None:
        raise CheckpointError(f"{tag}: the ZeRO-3 optimizer files do not match this model's unit plan (flat sizes "
                              f"{recorded[:len(sizes)]} vs {[sum(s) for s in sizes]}): it was written for another "
                              f"model, or with frozen parameters or several parameter groups; call "
                              f"engine.save_16bit_model at the layout that wrote it")
    names: dict[int, list[str]] = {}
    for name, p in reference.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out = dict(module)
    for k, (plan, numels) in enumerate(zip(plans, sizes)):
        layout = FlatLayout(tuple(numels), dp)
        flat = torch.zeros(layout.numel, dtype=torch.float32)
        for r in range(dp):
            shard = shards[r]["masters"][k]
            for i, lo, hi, start in layout.pieces_in_shard(r):
                off = layout.offsets[i]
                flat[off + lo:off + hi] = shard[start:start + hi - lo].float()
        for i, p in enumerate(plan.params):
            off = layout.offsets[i]
            value = flat[off:off + numels[i]].view(p.shape)
            for name in names[id(p)]:
                out[name] = value.to(module[name].dtype) if name in module else value
    return out


def load_weights(model: nn.Module, state: dict[str, Any]) -> None:
    """Copy a consolidated state dict into a full model (strict: every tensor present, no extra); tied weights
    are written once per name, which is the same values."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint does not fit the model: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}; check --model / RUN_DIR/model.json")
