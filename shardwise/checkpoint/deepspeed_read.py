"""A tag DeepSpeed wrote, seen through the layout-independent index: `load_checkpoint` then reads it like one
of ours (`reshard.py`), at any dp size and ZeRO stage, weights and optimizer state.

    read = DeepSpeedReader(tag_dir)         # DeepSpeed's files, each with an added view in our state format
    index = deepspeed_index(read)           # where each tensor lives, built from DeepSpeed's own metadata

What DeepSpeed writes (`runtime/engine.py` `_save_checkpoint`, `_save_zero_checkpoint`):

    mp_rank_00_model_states.pt              module, optimizer (stage 0: torch's state dict), lr_scheduler, counters,
                                            param_shapes (ZeRO: per group, name -> shape, in flat order),
                                            buffer_names, shared_params, client keys at the top level
    zero_pp_rank_D_mp_rank_00_model_states.pt    ZeRO-3 instead of the above, one per dp rank (placeholders)
    zero_pp_rank_D_mp_rank_00_optim_states.pt    ZeRO: rank D's flat fp32 partition(s) and the torch optimizer's
                                            state over them (`deepspeed_layout.py` says where each element is)

The view a file gets under `VIEW` is what `reshard.Assembler` reads of ours: {"optimizer": torch state dict,
"masters": [flat fp32 tensors] or None, "scaler": {"cur_scale", ...}}.
"""

from __future__ import annotations

import math
from pathlib import Path
from collections import OrderedDict
from typing import Any, Mapping

import torch

from shardwise.checkpoint import deepspeed_layout as layout
from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint.index import CheckpointIndex, Dims, Fragment, IndexEntry, TensorInfo
from shardwise.checkpoint.reshard import RUN_OWN_OPTIONS, FileReader

VIEW = "shardwise_view"
"""The key under which a DeepSpeed file's optimizer state is seen in our format (added when the file is read)."""

STATE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
    "universal_checkpoint_info",
})
"""The keys DeepSpeed's model-states file holds for itself; every other top-level key is the client state."""

def written_by_deepspeed(head: Mapping[str, Any]) -> bool:
    """A tag without our index whose model states carry DeepSpeed's metadata."""
    return "buffer_names" in head and "ds_version" in head


def _scaler_state(scaler: Any) -> dict[str, Any]:
    """DeepSpeed's LossScaler / DynamicLossScaler object as our scaler's state dict."""
    state: dict[str, Any] = {"cur_scale": float(getattr(scaler, "cur_scale", 1.0))}
    if getattr(scaler, "dynamic", False):
        state.update(cur_iter=scaler.cur_iter, last_overflow_iter=scaler.last_overflow_iter,
                     cur_hysteresis=getattr(scaler, "cur_hysteresis", getattr(scaler, "delayed_shift", 1)))
    return state


LAYER_FILE = ckpt.LAYER_FILE
PIPELINE_PREFIX = "layers."
"""Our PipelineModule's name for layer i is "layers.i"; DeepSpeed's is "i"."""


def pipeline_name(name: str) -> str:
    """A DeepSpeed PipelineModule's tensor name ("3.ln.weight") under ours ("layers.3.ln.weight")."""
    return PIPELINE_PREFIX + name


class DeepSpeedReader(FileReader):
    """DeepSpeed's files of one tag, each loaded once, with our view of their optimizer state added (and a
    pipeline layer file's tensors under our module's names, as "module")."""

    def __call__(self, name: str) -> Any:
        if name.startswith(UNIVERSAL_DIR + "/") and name not in self._open:
            self._open[name] = _universal_view(self.path / name)
        loaded = super().__call__(name)
        if isinstance(loaded, dict) and VIEW not in loaded:
            if "module" in loaded and loaded["module"] is None:
                # A pipeline's model states hold no module (its layers are in their own files): their tensors
                # stand in, where a stage-0 optimizer entry reads its parameter's value.
                merged: dict[str, torch.Tensor] = {}
                for f in sorted(p.name for p in self.path.iterdir() if LAYER_FILE.fullmatch(p.name)):
                    merged.update(self(f)["module"])
                loaded["module"] = merged
            loaded[VIEW] = _view(loaded)
        return loaded


UNIVERSAL_DIR = "zero"
"""DeepSpeed's universal checkpoint (ds_to_universal.py): TAG/zero/<parameter name>/{fp32,exp_avg,...}.pt, each
the whole parameter (TP slices merged), and TAG/zero/optimizer_state.pt with the param groups."""


def _universal_view(folder: Path) -> dict[str, Any]:
    """One parameter's folder of a universal checkpoint in our view: its fp32 value as the one master, its
    optimizer states as state 0."""
    if not (folder / "fp32.pt").is_file():
        raise ckpt.CheckpointError(f"universal checkpoint folder {folder} has no fp32.pt: the conversion is "
                                   f"incomplete; run ds_to_universal.py again")
    state: dict[str, Any] = {}
    master = None
    for file in sorted(folder.glob("*.pt")):
        saved = ckpt.torch_load(file)
        value = saved["param"] if isinstance(saved, dict) else saved
        if file.stem == "fp32":
            master = value.reshape(-1)
        else:
            state[file.stem] = value.reshape(-1) if torch.is_tensor(value) and value.dim() > 0 else value
    return {VIEW: {"optimizer": {"state": {0: state}}, "masters": [master], "scaler": {"cur_scale": 1.0}}}


def _view(loaded: dict[str, Any]) -> dict[str, Any] | None:
    sd = loaded.get(ckpt.OPTIMIZER_STATE_DICT)
    if isinstance(sd, dict) and "zero_stage" in sd:
        if int(sd["zero_stage"]) == 3:
            return {"optimizer": sd["optimizer_state_dict"], "masters": sd["fp32_flat_groups"],
                    "scaler": _scaler_state(sd.get("loss_scaler"))}
        return {"optimizer": sd["base_optimizer_state"], "masters": sd["single_partition_of_fp32_groups"],
                "scaler": _scaler_state(sd.get("loss_scaler"))}
    optimizer = loaded.get("optimizer")
    if isinstance(optimizer, dict) and "state" in optimizer:
        return {"optimizer": optimizer, "masters": None, "scaler": {"cur_scale": 1.0}}
    if isinstance(optimizer, dict) and "fp32_groups" in optimizer:         # bf16 / fp16: DeepSpeed's wrapper
        scaler = {"cur_scale": float(optimizer["cur_scale"])}
        if optimizer.get("dynamic_loss_scale"):
            scaler.update(cur_iter=optimizer["cur_iter"], last_overflow_iter=optimizer["last_overflow_iter"],
                          cur_hysteresis=1)
        masters = [m.reshape(-1) for group in optimizer["fp32_groups"] for m in group]
        return {"optimizer": optimizer["optimizer_state_dict"], "masters": masters, "scaler": scaler}
    return None


def _options(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params" and k not in RUN_OWN_OPTIONS}


def _group_of(param_groups: list[dict[str, Any]], index: int) -> dict[str, Any]:
    for group in param_groups:
        if index in group["params"]:
            return group
    raise ckpt.CheckpointError(f"the optimizer state of this DeepSpeed checkpoint has no param group holding "
                               f"tensor {index}: the file is damaged; restore it or load another tag")


def _numel(shape: Any) -> int:
    return int(math.prod(shape))


def deepspeed_index(read: DeepSpeedReader) -> CheckpointIndex:
    """Where each tensor of a DeepSpeed tag lives, in our index's terms. Raises `CheckpointError` for what it
    does not read (tensor parallelism, tied pipeline layers, DeepSpeed's elastic ZeRO-1/2 layout, bf16/fp16
    optimizer wrappers at stage 0)."""
    head = read(read.head)
    where = read.path
    dp = int(head.get("dp_world_size", 1))
    dims = head.get("checkpoint_parallel_dimensions") or {}
    tp, pp = int(dims.get("tp_degree", 1)), int(dims.get("pp_degree", 1))
    layers = sorted((int(m.group(1)), f.name) for f in where.iterdir() if (m := LAYER_FILE.fullmatch(f.name)))
    pipeline = bool(layers)
    if tp != 1 or int(head.get("mp_world_size", 1)) != (pp if pipeline else 1):
        raise ckpt.CheckpointError(f"{where} was written by DeepSpeed with tensor parallelism (mp_world_size="
                                   f"{head.get('mp_world_size')}, {dims}); shardwise reads DeepSpeed checkpoints "
                                   f"without it: convert it with DeepSpeed's ds_to_universal.py and load the "
                                   f"universal checkpoint")
    rename = pipeline_name if pipeline else (lambda n: n)
    tensors: dict[str, TensorInfo] = {}
    held: dict[str, dict[int, str]] = {}
    buffers: set[str] = set()
    module_order: list[tuple[str, torch.Tensor]] = []       # every tensor, in the model's order
    model_files = [ckpt.model_states_name(m) for m in range(pp)] if pipeline else [read.head]
    for file in model_files:
        buffers |= {rename(b) for b in read(file).get("buffer_names") or ()}
    sources = [(f, read(f)["module"]) for _, f in layers] if pipeline else [(read.head, head["module"] or {})]
    for file, module in sources:
        for name, t in module.items():
            tensors[name] = TensorInfo(tuple(t.shape), None)
            module_order.append((name, t))
            if t.numel() > 0 or name in buffers:
                held[name] = {0: file}
    entries: list[IndexEntry] = []
    fragments: dict[str, list[Fragment]] = {}
    if (where / UNIVERSAL_DIR / "optimizer_state.pt").is_file():
        _universal(read, head, tensors, entries, fragments)
        return CheckpointIndex(dims=Dims(dp=dp, tp=1, pp=1), tensors=tensors, module=held, entries=tuple(entries),
                               fragments={n: tuple(f) for n, f in fragments.items()})
    params = _distinct_params(module_order, buffers)
    for mp_rank, file in enumerate(model_files):
        states = read(file)
        shapes: list[Mapping[str, Any]] | None = states.get("param_shapes")
        if shapes is None:
            params = _stage0(read, file, states, params, entries, fragments)
            continue
        shapes = [OrderedDict((rename(n), s) for n, s in group.items()) for group in shapes]
        if any(n.startswith(PIPELINE_PREFIX + "tied_modules.") for g in shapes for n in g):
            raise ckpt.CheckpointError(f"{where}: DeepSpeed's pipeline here ties layers (TiedLayerSpec), whose "
                                       f"names shardwise does not map; load it with DeepSpeed and save the "
                                       f"weights with save_16bit_model")
        for group in shapes:
            for name, shape in group.items():
                tensors[name] = TensorInfo(tuple(int(n) for n in shape), None)
        _zero(read, dp, mp_rank, shapes, entries, fragments)
    for alias, source in (head.get("shared_params") or {}).items():
        if rename(source) in tensors:
            tensors[rename(alias)] = tensors[rename(source)]
    return CheckpointIndex(dims=Dims(dp=dp, tp=1, pp=pp), tensors=tensors, module=held, entries=tuple(entries),
                           fragments={n: tuple(f) for n, f in fragments.items()})


def _universal(read: DeepSpeedReader, head: dict[str, Any], tensors: dict[str, TensorInfo],
               entries: list[IndexEntry], fragments: dict[str, list[Fragment]]) -> None:
    """A universal checkpoint: one entry per parameter, its whole value (any dp, tp, ZeRO stage reads it)."""
    common = ckpt.torch_load(read.path / UNIVERSAL_DIR / "optimizer_state.pt")
    groups = common.get("param_groups") or [{}]
    for g, shapes in enumerate(head.get("param_shapes") or []):
        options = _options(groups[min(g, len(groups) - 1)])
        for name, shape in shapes.items():
            if not (read.path / UNIVERSAL_DIR / name).is_dir():
                continue                # not converted (frozen): the model states' value, if any
            numel = _numel(shape)
            tensors[name] = TensorInfo(tuple(int(n) for n in shape), None)
            fragments[name] = [Fragment(0, 0, numel, len(entries), 0)]
            entries.append(IndexEntry(f"{UNIVERSAL_DIR}/{name}", VIEW, 0, 0, numel, options))


def _distinct_params(module: list[tuple[str, torch.Tensor]], buffers: set[str]) -> list[str]:
    """The parameters of saved module states in order: without buffers and tied copies (one storage)."""
    seen: set[tuple[int, int]] = set()
    names = []
    for name, t in module:
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if name in buffers or key in seen:
            continue
        seen.add(key)
        names.append(name)
    return names


def _stage0(read: DeepSpeedReader, file: str, states: dict[str, Any], params: list[str],
            entries: list[IndexEntry], fragments: dict[str, list[Fragment]]) -> list[str]:
    """ZeRO stage 0: torch's optimizer state dict in the model states (one per pipeline stage), its tensors
    numbered in the order of the model's parameters: DeepSpeed saves no names for them, so they are the next
    `params` in order (those of the stage's layers). Returns the parameters left for the next stages."""
    optimizer = states.get("optimizer")
    if optimizer is None:
        return params                              # saved without an optimizer: weights only
    wrapped = "fp32_groups" in optimizer          # bf16 / fp16: the fp32 masters beside torch's state dict
    if wrapped:
        optimizer = optimizer["optimizer_state_dict"]
    if "state" not in optimizer or "param_groups" not in optimizer:
        raise ckpt.CheckpointError(f"{read.path}: DeepSpeed's stage-0 optimizer state here is an optimizer "
                                   f"wrapper's ({sorted(optimizer)[:4]}...), which shardwise does not read; load it "
                                   f"with load_module_only=True, or save it in fp32")
    count = sum(len(g["params"]) for g in optimizer["param_groups"])
    if count > len(params):
        raise ckpt.CheckpointError(f"{read.path}: DeepSpeed's optimizer steps {count} tensors but the model states "
                                   f"hold {len(params)} more parameters; it was written for another model")
    mine = {i: name for i, name in enumerate(params[:count])}
    module = {n: t for n, t in _module_tensors(read, file).items()}
    for group in optimizer["param_groups"]:
        for i in group["params"]:
            name = mine[i]
            numel = module[name].numel()
            saved = optimizer["state"].get(i, {})
            moment = next((v for v in saved.values() if torch.is_tensor(v) and v.dim() > 0), None)
            if moment is not None and moment.numel() != numel:
                raise ckpt.CheckpointError(f"{read.path}: DeepSpeed's optimizer tensor {i} has {moment.numel()} "
                                           f"elements and parameter {name!r} {numel}: the optimizer was built over "
                                           f"the parameters in another order than the model's; shardwise reads "
                                           f"only the model's order")
            fragments.setdefault(name, []).append(Fragment(0, 0, numel, len(entries), 0))
            # The fp32 master i (flattened over the groups, torch's numbering) when wrapped, else the parameter.
            entries.append(IndexEntry(file, VIEW, i, i if wrapped else None, numel, _options(group)))
    return params[count:]


def _module_tensors(read: DeepSpeedReader, file: str) -> dict[str, torch.Tensor]:
    """The weights a stage-0 optimizer steps, by name: the file's module (a pipeline's: its layer files')."""
    return dict(read(file)["module"])


def _zero(read: DeepSpeedReader, dp: int, mp_rank: int, shapes: list[Mapping[str, Any]], entries: list[IndexEntry],
          fragments: dict[str, list[Fragment]]) -> None:
    """ZeRO 1-3: one entry per (dp rank, flat group), fragments from DeepSpeed's flat layout."""
    files = [ckpt.optim_states_name(r, mp_rank) for r in range(dp)]
    if not (read.path / files[0]).is_file() and (read.path / ("bf16_" + files[0])).is_file():
        files = ["bf16_" + f for f in files]        # DeepSpeed's name when it trained in bf16
    first = read(files[0])[ckpt.OPTIMIZER_STATE_DICT]
    stage = int(first["zero_stage"])
    view = read(files[0])[VIEW]
    if stage < 3 and not isinstance(first["base_optimizer_state"], dict):
        raise ckpt.CheckpointError(f"{read.path} was written with DeepSpeed's zero_optimization.elastic_checkpoint, "
                                   f"which shardwise does not read; convert it with ds_to_universal.py")
    param_groups = view["optimizer"]["param_groups"]
    paddings = first.get("param_alignment_paddings") or [[0] * len(g) for g in shapes]
    for g, group in enumerate(shapes):
        numels = [_numel(s) for s in group.values()]
        if stage == 3:
            runs = layout.zero3_runs(numels, dp)
            flat = [layout.zero3_flat_numel(numels, dp)] * dp
        else:
            runs = layout.zero12_runs(numels, paddings[g], dp)
            part = layout.zero12_partition_numel(numels, paddings[g], dp)
            total = sum(numels) + sum(paddings[g])
            flat = [max(0, min(part, total - r * part)) for r in range(dp)]     # saved without the end padding
        optimizer_index = param_groups[g]["params"][0] if stage < 3 else g
        options = _options(_group_of(param_groups, optimizer_index))
        base = len(entries)
        for r in range(dp):
            entries.append(IndexEntry(files[r], VIEW, optimizer_index, g, flat[r], options))
        for name, param_runs in zip(group, runs):
            fragments.setdefault(name, []).extend(Fragment(0, run.lo, run.hi, base + run.rank, run.dst)
                                                  for run in param_runs)


def client_state(head: Mapping[str, Any], reserved: frozenset[str]) -> dict[str, Any]:
    """What DeepSpeed's load_checkpoint returns as the client state: every top-level key it does not keep for
    itself (and, for a tag of ours, none of ours)."""
    return {k: v for k, v in head.items() if k not in STATE_KEYS and k not in reserved and k != VIEW}
