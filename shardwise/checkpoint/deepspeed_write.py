"""What our tags add so that DeepSpeed reads them: its model-states keys and, under ZeRO, its optimizer files'
contents in its own flat layout (`deepspeed_layout.py`). DeepSpeed's `load_checkpoint` and its `zero_to_fp32.py`
then read a tag of ours as one of its own (fp32, without tensor or pipeline parallelism).

Our ZeRO shards are cut otherwise than DeepSpeed's partitions (per bucket or unit, not per param group), so
the DeepSpeed view of rank r's optimizer state holds elements other ranks hold. A save therefore runs in two
phases (`files.write_tag`): every rank writes its own shard (under `files.NATIVE_OPTIMIZER_STATE_DICT`, which
our index points to);
then rank r reads, through the index, the elements of DeepSpeed's partition r from the staged files and rewrites
its file with both.

Only builtins and torch types are pickled (DeepSpeed opens the files without shardwise installed), except
the `loss_scaler`, which DeepSpeed requires to be its own class: it is pickled as a reference to
DeepSpeed's class, resolved when DeepSpeed opens the file (`files.torch_load` resolves it to a plain record where
DeepSpeed is not installed).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

import torch

from shardwise.checkpoint import deepspeed_layout as layout
from shardwise.checkpoint.index import CheckpointIndex
from shardwise.comm.topology import Axis
from shardwise.checkpoint.reshard import RUN_OWN_OPTIONS, VALUE, FileReader, Assembler, per_element

if TYPE_CHECKING:
    from shardwise.checkpoint.context import CheckpointContext

DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed whose checkpoint format these files follow (its loaders check `ds_version`)."""


class Group:
    """One of DeepSpeed's flat groups: a param group's trainable parameters of this rank's module, in the
    model's order, under their full names, with their (TP-local) shapes."""

    def __init__(self, options: dict[str, Any]):
        self.options = options
        self.names: list[str] = []
        self.shapes: list[torch.Size] = []

    @property
    def numels(self) -> list[int]:
        return [s.numel() for s in self.shapes]


def flat_groups(ctx: CheckpointContext) -> list[Group]:
    """DeepSpeed's flat groups of this rank's module: the parameters the optimizer steps in the module's order,
    split into param groups by their options, in order of first appearance. DeepSpeed flattens each group in
    the order its param group lists them: the model's order for `model.parameters()` and for groups listing
    their parameters in model order, as Hugging Face's and DeepSpeed's examples build them. Collective over dp:
    a ZeRO rank steps pieces of only some parameters, the dp ranks together of all."""
    names = ctx.naming.full_names(ctx.module)
    mine: dict[int, tuple[tuple[int, ...], dict[str, Any]]] = {}
    for entry in ctx.state.entries():
        options = {k: v for k, v in entry.options.items() if k not in RUN_OWN_OPTIONS}
        for piece in entry.pieces:
            mine.setdefault(id(piece.param), (tuple(piece.shape), options))
    local = {id(p): names[n] for n, p in ctx.module.named_parameters()}
    stepped: dict[str, tuple[tuple[int, ...], dict[str, Any]]] = {}
    for part in ctx.comm(Axis.DP).all_gather_object({local[k]: v for k, v in mine.items()}):
        for name, value in part.items():
            stepped.setdefault(name, value)
    groups: list[Group] = []
    for name in dict.fromkeys(local.values()):
        if name not in stepped:
            continue                    # frozen
        shape, options = stepped[name]
        group = next((g for g in groups if g.options == options), None)
        if group is None:
            group = Group(options)
            groups.append(group)
        group.names.append(name)
        group.shapes.append(torch.Size(shape))
    return groups


def model_state_keys(ctx: CheckpointContext, groups: list[Group], *, zero_stage: int,
                     exclude_frozen: bool, strip: str = "") -> dict[str, Any]:
    """DeepSpeed's metadata keys of a model-states file (`_common_checkpoint_state`). `strip`: a prefix our names
    have and DeepSpeed's not (a PipelineModule's layer "layers.3" is DeepSpeed's "3")."""
    names = {k: v[len(strip):] if strip and v.startswith(strip) else v
             for k, v in ctx.naming.full_names(ctx.module).items()}

    def ds(name: str) -> str:
        return name[len(strip):] if strip and name.startswith(strip) else name

    params = {n for n, _ in ctx.module.named_parameters(remove_duplicate=False)}
    buffers = [names[n] for n in ctx.module.state_dict(keep_vars=True) if n not in params]
    first: dict[int, str] = {}
    shared: dict[str, str] = {}
    for local, p in ctx.module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            shared[names[local]] = first[id(p)]
        else:
            first[id(p)] = names[local]
    zero = zero_stage > 0
    frozen = [(names[n], p) for n, p in ctx.module.named_parameters() if not p.requires_grad]
    # DeepSpeed keeps frozen weights beside the flat groups from ZeRO-2 on (stage 2: whole). At stage 3 they would
    # be the rank's piece, which our ZeRO-3 does not hold apart: None there (DeepSpeed then keeps its own values),
    # as with exclude_frozen_parameters; an empty dict where there are none, as DeepSpeed writes it.
    frozen_kept: OrderedDict[str, Any] | None = None
    frozen_shapes: OrderedDict[str, Any] | None = None
    if zero_stage >= 2 and not exclude_frozen and (zero_stage == 2 or not frozen):
        frozen_kept = OrderedDict((n, p.detach().cpu()) for n, p in frozen)
        frozen_shapes = OrderedDict((n, p.shape) for n, p in frozen)
    return {
        "buffer_names": buffers,
        "param_shapes": [OrderedDict(zip(map(ds, g.names), g.shapes)) for g in groups] if zero else None,
        "frozen_param_shapes": frozen_shapes,
        "shared_params": shared if zero else None,
        "frozen_param_fragments": frozen_kept,
        "data_sampler": None,
        "random_ltd": None,
        "ds_version": DEEPSPEED_VERSION,
    }


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    """The scheduler's state dict with only plain values (DeepSpeed unpickles it without shardwise), plus
    DeepSpeed's `last_batch_iteration` for our closed-form schedules (iteration = last_epoch - 1)."""
    state = {k: v for k, v in scheduler.state_dict().items() if _plain(v)}
    if hasattr(scheduler, "_lrs_at"):
        state["last_batch_iteration"] = scheduler.last_epoch - 1
    return state


def stage0_optimizer(ctx: CheckpointContext, native: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's stage-0 `optimizer`: torch's state dict in fp32; in bf16 / fp16 its FP16_UnfusedOptimizer's
    (the loss scale, torch's state dict over the fp32 masters, and the masters per param group). The tensors are
    our state dict's own (pickled once)."""
    if native["masters"] is None:
        return dict(native["optimizer"])
    master_of = {e.optimizer_index: e.master_index for e in ctx.state.entries()}
    groups = [[native["masters"][master_of[i]] for i in g["params"]] for g in native["optimizer"]["param_groups"]]
    scaler = native["scaler"]
    state: dict[str, Any] = {"dynamic_loss_scale": "cur_iter" in scaler, "cur_scale": scaler["cur_scale"],
                             "cur_iter": scaler.get("cur_iter", 0)}
    if "cur_iter" in scaler:
        fp16 = ctx.raw_config.get("fp16") or {}
        state.update(last_overflow_iter=scaler["last_overflow_iter"], scale_factor=2.0,
                     scale_window=int(fp16.get("loss_scale_window", 1000)))
    return {**state, "optimizer_state_dict": native["optimizer"], "fp32_groups": groups}


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


class _Reference:
    """Pickles as `getattr(import_module(module), name)`: a class named, not imported, at save time."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:          # pickle requires a reduce's callable to be callable
        raise TypeError("a reference to be resolved when unpickled")

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return getattr, (_Module(self.module), self.name)


class _Module:
    def __init__(self, module: str):
        self.module = module

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return importlib.import_module, (self.module,)


class _DeepSpeedLossScaler:
    """DeepSpeed's `LossScaler(scale)` or `DynamicLossScaler(...)` with its counters, pickled as a call of its
    class followed by its attributes."""

    def __init__(self, name: str, args: tuple[Any, ...], state: dict[str, Any]):
        self.name, self.args, self.state = name, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        made = (_Reference("deepspeed.runtime.fp16.loss_scaler", self.name), self.args)
        return (*made, self.state) if self.state else made


def loss_scaler(scaler: dict[str, Any], raw_config: dict[str, Any]) -> _DeepSpeedLossScaler:
    """Our loss scaler's state as DeepSpeed's object: dynamic (fp16 with loss_scale 0, its window, floor and
    hysteresis from the config, the counters from the state) or static."""
    fp16 = raw_config.get("fp16") or {}
    if "cur_iter" not in scaler:
        return _DeepSpeedLossScaler("LossScaler", (float(scaler["cur_scale"]),), {})
    args = (float(scaler["cur_scale"]), int(fp16.get("loss_scale_window", 1000)), float(fp16.get("min_loss_scale", 1)),
            int(fp16.get("hysteresis", 2)), bool(fp16.get("consecutive_hysteresis", False)))
    return _DeepSpeedLossScaler("DynamicLossScaler", args,
                                {"cur_iter": scaler["cur_iter"], "last_overflow_iter": scaler["last_overflow_iter"],
                                 "cur_hysteresis": scaler["cur_hysteresis"]})


def zero_optimizer_state(ctx: CheckpointContext, index: CheckpointIndex, read: FileReader, groups: list[Group], *,
                         zero_stage: int, clip: float, scaler: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's `optimizer_state_dict` of this rank's ZeRO file: its partition of each flat group (fp32
    values and per-element optimizer states, assembled from every rank's staged shard through `index`), the
    optimizer's scalars and options."""
    build = Assembler(index, read)
    dp, rank = ctx.dp_size, ctx.dp_rank
    flats, states, param_groups = [], {}, []
    for g, group in enumerate(groups):
        numels = group.numels
        if zero_stage == 3:
            runs, size = layout.zero3_runs(numels, dp), layout.zero3_flat_numel(numels, dp)
        else:
            pads = [0] * len(numels)
            runs, size = layout.zero12_runs(numels, pads, dp), layout.zero12_partition_numel(numels, pads, dp)
        saved = _saved_state(index, read, group.names[0])
        keys = [VALUE] + [k for k, v in saved.items() if per_element(v)]
        out = {k: torch.zeros(size, dtype=torch.float32) for k in keys}
        for name, param_runs in zip(group.names, runs):
            for run in param_runs:
                if run.rank == rank:
                    for k in keys:
                        out[k][run.dst:run.dst + run.hi - run.lo] = build.local(name, 0, 1, None, run.lo, run.hi, k)
        state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in saved.items() if not per_element(v)}
        state.update({k: out[k] for k in keys if k != VALUE})
        states[g] = state
        flat = out[VALUE]
        if zero_stage < 3:      # DeepSpeed saves its fp32 partition without the group's end padding
            flat = flat[:max(0, min(size, sum(numels) - rank * size))].clone()
        flats.append(flat)
        param_groups.append({**group.options, "params": [g]})
    optimizer = {"state": states, "param_groups": param_groups}
    if zero_stage == 3:
        return {"zero_stage": 3, "loss_scaler": loss_scaler(scaler, ctx.raw_config),
                "dynamic_loss_scale": "cur_iter" in scaler, "overflow": False, "partition_count": dp,
                "optimizer_state_dict": optimizer,
                "fp32_flat_groups": flats}
    totals = [sum(g.numels) for g in groups]
    sizes = [layout.zero12_partition_numel(g.numels, [0] * len(g.numels), dp) for g in groups]
    return {"loss_scaler": loss_scaler(scaler, ctx.raw_config), "dynamic_loss_scale": "cur_iter" in scaler,
            "overflow": False, "clip_grad": clip,
            "base_optimizer_state": optimizer, "single_partition_of_fp32_groups": flats,
            "zero_stage": zero_stage,
            "group_paddings": [min(s, max(0, (rank + 1) * s - t)) for s, t in zip(sizes, totals)],
            "param_alignment_paddings": [[0] * len(g.names) for g in groups],
            "partition_count": [dp] * len(groups), "ds_version": DEEPSPEED_VERSION}


def _saved_state(index: CheckpointIndex, read: FileReader, name: str) -> dict[str, Any]:
    """The optimizer state (per parameter) of the saved tensor holding `name`'s first fragment."""
    entry = index.entries[index.fragments[name][0].entry]
    state: dict[str, Any] = read(entry.file)[entry.key]["optimizer"]["state"].get(entry.optimizer_index, {})
    return state
