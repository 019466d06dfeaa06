"""A checkpoint's whole model on one process, from the files of any layout: what `engine.save_16bit_model` assembles
with the ranks that trained (ZeRO-3 shards gathered, TP slices joined, pipeline stages merged), read here from the
files alone. `shardwise eval`, `generate` and `export` load models through it.

    state = consolidated_state_dict("runs/x/checkpoints", reference=model)   # single-process names -> tensors

Only this module knows the file layout of a consolidation; a layout-independent index, when checkpoints carry
one, replaces its readers without changing the callers.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from shardwise.checkpoint import files as ckpt
from shardwise.errors import CheckpointError

CHECKPOINT_DIR = "checkpoints"


def resolve_checkpoint(path: str | Path) -> Path:
    """The tag directory meant by `path`: a run directory (its checkpoints' `latest`), a checkpoints directory
    (its `latest`), or a tag directory itself."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{str(p)!r}: no such run directory or checkpoint")
    if ckpt.head_name(p) is not None:
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
    model does): it gives the full shapes to join TP slices and ZeRO-3's unit plan.

    What the files hold (`save_load.py`): one `mp_rank_MM_model_states.pt` per (pipeline stage, TP rank),
    MM = stage * tp + tp_rank, its module states under the full model's names; ZeRO stages 0-2 keep whole
    (TP-sliced) weights there. ZeRO-3 keeps empty placeholders there and the weights in the per-rank optimizer
    files (`_fill_zero3`).
    """
    tag = resolve_checkpoint(path)
    from shardwise.checkpoint.index import read_index
    index = read_index(tag)
    if index is not None:
        return _from_index(tag, index, reference)
    head = ckpt.read_model_states(tag, 0)
    tp, pp = int(head.get("mp_world_size", 1)), int(head.get("pp_world_size", 1))
    full = reference.state_dict(keep_vars=True)
    per_tp = [_merge_stages(tag, tp_rank, tp, pp) for tp_rank in range(tp)]
    if any(t.numel() == 0 and full[k].numel() > 0 for k, t in per_tp[0].items() if k in full):
        sliced = _tp_slice_shapes(reference, tp) if pp == 1 else None
        if sliced is None:
            raise CheckpointError(f"{tag}: a ZeRO-3 checkpoint written with tensor_parallel.size = {tp}, "
                                  f"pipeline.stages = {pp} (of a {type(reference).__name__}): consolidating it "
                                  f"needs the ranks that wrote it; call engine.save_16bit_model at that layout")
        per_tp = [_fill_zero3(tag, head, per_tp[r], sliced, tp_rank=r) for r in range(tp)]
    missing, unexpected = sorted(set(full) - set(per_tp[0])), sorted(set(per_tp[0]) - set(full))
    if missing or unexpected:
        example = f"no weights for {missing[0]}" if missing else f"weights for {unexpected[0]}, not in the model"
        raise CheckpointError(f"{tag} does not fit the model ({example}): it was written for another model; "
                              f"check --model / RUN_DIR/model.json")
    return {name: _join_tp(name, [s[name] for s in per_tp], full[name].shape) for name in full}


def _from_index(tag: Path, index: Any, reference: nn.Module) -> dict[str, Tensor]:
    """Every tensor through the tag's index (`index.py`): from the model states where they hold it, else (a
    ZeRO-3 parameter) from the masters of the optimizer shards; TP slices joined along their split dim."""
    from shardwise.checkpoint.reshard import VALUE, FileReader, Assembler
    build = Assembler(index, FileReader(tag))
    source: dict[int, str] = {}
    for name, p in reference.named_parameters(remove_duplicate=False):
        source.setdefault(id(p), name)
    first = {name: source[id(p)] for name, p in reference.named_parameters(remove_duplicate=False)}
    out: dict[str, Tensor] = {}
    for name, t in reference.state_dict(keep_vars=True).items():
        info = index.tensors.get(name)
        held = first.get(name, name)
        key = "module" if name in index.module else VALUE
        if info is None or (key == VALUE and held not in index.fragments):
            raise CheckpointError(f"{tag} does not fit the model (no weights for {name}): it was written for "
                                  f"another model; check --model / RUN_DIR/model.json")
        if tuple(info.shape) != tuple(t.shape):
            raise CheckpointError(f"checkpoint tensor {name!r} has shape {tuple(info.shape)} and the model "
                                  f"{tuple(t.shape)}: it was written for another model; check --model / "
                                  f"RUN_DIR/model.json")
        value = build.local(name if key == "module" else held, 0, 1, info.tp_dim, 0, t.numel(), key).view(t.shape)
        dtype = _saved_dtype(build, index, name) if key == VALUE else value.dtype
        out[name] = value.to(dtype)
    extra = sorted(set(index.tensors) - set(out))
    if extra:
        raise CheckpointError(f"{tag} does not fit the model (weights for {extra[0]}, not in the model): it was "
                              f"written for another model; check --model / RUN_DIR/model.json")
    return out


def _saved_dtype(build: Any, index: Any, name: str) -> torch.dtype:
    """The training dtype of a parameter whose value comes from the fp32 masters: its model-states placeholder's."""
    for mp_rank in range(index.dims.tp * index.dims.pp):
        placeholder = (build.read(ckpt.model_states_file(build.read.path, mp_rank).name)["module"] or {}).get(name)
        if placeholder is not None:
            return placeholder.dtype  # type: ignore[no-any-return]
    return torch.float32


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


def _zero3_thresholds(head: dict[str, Any], world: int) -> tuple[int, int]:
    from shardwise.config import ConfigWarning, load_config_for_world
    raw = head.get("ds_config") or {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        cfg = load_config_for_world(copy.deepcopy(raw), world_size=world)
    return cfg.zero.stage3_param_persistence_threshold, cfg.zero.stage3_model_persistence_threshold


def _tp_slice_shapes(reference: nn.Module, tp: int) -> nn.Module | None:
    """A meta copy of `reference` whose parameters have one TP rank's slice shapes (what ZeRO-3 partitioned after
    tensor parallelism cut the model), shared parameters still shared; the reference itself at tp 1. Only our
    GPT's plan is known here (None otherwise): column-parallel weights and biases and vocabulary tables are cut
    along dim 0, row-parallel weights along dim 1."""
    if tp == 1:
        return reference
    from shardwise.models.gpt import GPT
    from shardwise.models.parallelize import gpt_tp_plan
    from shardwise.parallel.tensor_parallel.plan import COLWISE_STYLES, ROWWISE_STYLES, VOCAB_STYLES, resolve_plan
    if not isinstance(reference, GPT):
        return None
    plan = gpt_tp_plan(learned_positions=reference.cfg.positions == "learned", swiglu=reference.cfg.mlp == "swiglu")
    styles = resolve_plan((n for n, _ in reference.named_modules()), plan, strict=False)
    sliced = copy.deepcopy(reference).to("meta")
    made: dict[int, nn.Parameter] = {}
    for name, module in sliced.named_modules():
        style = styles.get(name)
        for p_name, p in list(module.named_parameters(recurse=False)):
            dim = (0 if style in COLWISE_STYLES | VOCAB_STYLES else
                   1 if style in ROWWISE_STYLES and p_name == "weight" else None)
            if dim is None:
                continue
            if id(p) not in made:
                shape = list(p.shape)
                shape[dim] //= tp
                made[id(p)] = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=p.requires_grad)
            setattr(module, p_name, made[id(p)])
    return sliced


@torch.no_grad()
def _fill_zero3(tag: Path, head: dict[str, Any], module: dict[str, Tensor], reference: nn.Module, *,
                tp_rank: int = 0) -> dict[str, Tensor]:
    """ZeRO-3 (one pipeline stage): the placeholders of TP rank `tp_rank`'s `module` states filled from its dp
    ranks' master shards; `reference` has that rank's slice shapes.

    The optimizer files hold the fp32 master shards of each unit's flat buffer, in unit order. The unit plan is
    rebuilt from the reference model with the run's persistence thresholds (`plan_units`, the code ZeRO-3
    partitions with) and checked against the flat sizes the files record before any value is used. Under tensor
    parallelism (our GPT's plan) the caller makes it on a meta copy with one TP rank's slice shapes
    (`_tp_slice_shapes`), once per TP rank, and then joins the ranks' slices.
    """
    from shardwise.parallel.zero.params import plan_units
    from shardwise.parallel.zero.partition import FlatLayout
    dp = int(head.get("dp_world_size", 1))
    threshold, model_threshold = _zero3_thresholds(head, dp * int(head.get("mp_world_size", 1)))
    plans, _ = plan_units(reference, persistence_threshold=threshold, model_persistence_threshold=model_threshold)
    shards = [ckpt.native_optimizer_state(ckpt.read_optim_states(tag, r, tp_rank)) for r in range(dp)]
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
