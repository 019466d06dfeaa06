"""`materialize_sharded`: build a ZeRO-3 model from the meta device without ever holding it whole on one rank."""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from shardwise.comm.collectives import Comm
from shardwise.errors import UserError
from shardwise.parallel.zero.flat import FlatKey
from shardwise.parallel.zero.params import PARTITION_ATTR, Partition, build_units, plan_units


def _default_init(model: nn.Module) -> None:
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


@torch.no_grad()
def _replace_meta_params(model: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Swap every meta Parameter for an empty placeholder Parameter on `device`, keeping sharing (a tied
    parameter stays one object). Returns {id(old): new}."""
    memo: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if p.device.type != "meta":
                raise UserError(f"materialize_sharded: parameter {type(module).__name__}.{name} is on {p.device}, "
                                f"not on the meta device: build the model under `with torch.device('meta'):`")
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(torch.empty(0, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]
    return memo


@torch.no_grad()
def materialize_sharded(model: nn.Module, *, comm: Comm, init: Callable[[nn.Module], None] | None = None,
                        device: torch.device | str | None = None, persistence_threshold: int = 100_000,
                        model_persistence_threshold: int = 2 ** 63 - 1,
                        broadcast_from_rank0: bool = True) -> nn.Module:
    """Materialize a meta-device `model` as ZeRO-3 shards over `comm`'s group.

        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(cfg)                                 # shapes only: no memory, no RNG draws
        materialize_sharded(model, init=GPT.init_weights, comm=Comm(None, CommLedger()))
        engine, *_ = shardwise.initialize(model=model, config={..., "zero_optimization": {"stage": 3}})

    The parameters are materialized and initialized one module at a time, in `named_modules()` order: each
    module's own parameters are allocated, initialized, broadcast from dp rank 0 (so every rank agrees whatever
    its seed), and cut down to this rank's part of their unit's flat shard; only then is the next module
    allocated. Peak memory is the shards plus one module's parameters (a parameter shared by several modules
    lives from the first module that registers it to the last). Persistent parameters (tiny) stay whole.

    `init(model)` must walk `model.named_modules()` (or `model.modules()`) once and, at each module, touch only
    that module's own parameters: during the call `model.named_modules` yields each module with exactly those
    parameters materialized. GPT.init_weights is written that way, so the weights are bit-identical to `GPT(cfg)`
    built directly under the same seed (the meta build draws no random numbers). An init that reaches into other
    modules' parameters (nn.MultiheadAttention.reset_parameters initializes its out_proj child) initializes
    nothing there, and the values differ from a direct build. Buffers are allocated uninitialized: an init must
    set any buffer the model needs.

    The thresholds must equal the config's `zero_optimization.stage3_param_persistence_threshold` and
    `stage3_model_persistence_threshold` (DeepSpeed's defaults here); `shardwise.initialize` checks. Returns
    `model`, whose sharded parameters are empty placeholders until the stage-3 engine gathers them."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    init = _default_init if init is None else init
    plans, persistent = plan_units(model, persistence_threshold=persistence_threshold,
                                   model_persistence_threshold=model_persistence_threshold)
    shapes = {id(p): p.shape for plan in plans for p in plan.params} | {id(p): p.shape for p in persistent}
    memo = _replace_meta_params(model, device)
    shape_of = {id(memo[k]): s for k, s in shapes.items()}
    plans = [type(plan)(plan.name, plan.module, [memo[id(p)] for p in plan.params], plan.is_root) for plan in plans]
    persistent = [memo[id(p)] for p in persistent]
    units = build_units(plans, key_of=lambda p: FlatKey(0 if p.requires_grad else None, p.dtype),
                        shape_of=lambda p: shape_of[id(p)], dp_size=comm.size, dp_rank=comm.rank, device=device,
                        grad_shards=False)          # the engine re-keys the flats by param group and adds them
    where = {id(p): (f, i) for u in units for f in u.flats for i, p in enumerate(f.params)}
    modules = list(model.named_modules())
    last_module = {id(p): k for k, (_, m) in enumerate(modules) for p in m._parameters.values() if p is not None}
    done: set[int] = set()
    alive: set[int] = set()
    state = {"walks": 0, "finished": False}

    def finish(params: list[nn.Parameter]) -> None:
        if broadcast_from_rank0:
            comm.broadcast_coalesced(params)
        for p in params:
            if id(p) in where:            # sharded: keep this rank's part only
                flat, i = where[id(p)]
                flat.copy_piece(i, p)
                p.data = flat.empty

    def streamed(*args, **kwargs) -> Iterator[tuple[str, nn.Module]]:
        state["walks"] += 1
        if state["walks"] > 1:
            raise UserError("materialize_sharded: init walked model.named_modules() twice; it must walk it once, "
                            "initializing each module's own parameters as it goes")
        for k, (name, module) in enumerate(modules):
            own = list({id(p): p for p in module._parameters.values() if p is not None and id(p) not in done}.values())
            for p in own:
                if id(p) not in alive:         # a shared parameter is allocated at its first module only
                    alive.add(id(p))
                    p.data = torch.empty(shape_of[id(p)], dtype=p.dtype, device=device)
            for bname, b in module._buffers.items():
                if b is not None and b.device.type == "meta":
                    module._buffers[bname] = torch.empty_like(b, device=device)
            yield name, module
            ready = [p for p in own if last_module[id(p)] == k]
            done.update(id(p) for p in ready)
            finish(ready)
        state["finished"] = True

    model.named_modules = streamed                     # type: ignore[method-assign]
    try:
        init(model)
    finally:
        del model.named_modules
    if not state["finished"]:
        raise UserError("materialize_sharded: init did not walk model.named_modules() (or model.modules()) to the "
                        "end, so some parameters were never materialized: build the model inside `with "
                        "zero.Init():` with real tensors instead (its own constructors initialize it)")
    setattr(model, PARTITION_ATTR, Partition(units, persistent, comm.size, comm.rank, persistence_threshold,
                                             model_persistence_threshold))
    return model
