"""Weights tied across pipeline stages (DeepSpeed's TiedLayerSpec): a GPT-2 embedding used again as the output
projection.

In the full model one module is shared by several layers, each use a `TiedLayer`. Where several stages hold one,
each keeps a copy: `build_ties` makes the copies equal from the first sharing stage and hands the update strategies
the `TiedParams` whose gradients they sum over the sharing stages before the norm and the step.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.parallel.pipeline.schedules import PipelineError
from shardwise.parallel.tied import TiedParam, TiedParams
from shardwise.comm.topology import Axis, ParallelMesh

ForwardFn = Callable[[nn.Module, Any], Any]
"""forward_fn(tied module, inputs) -> outputs, e.g. ``lambda embed, h: h @ embed.weight.T``."""


class TiedLayer(nn.Module):
    """One use of a tied module: ``forward_fn(module, x)``, or ``module(x)`` without a forward_fn. The module
    is held by reference, not as a child: whoever holds the layer registers it once (the full model's
    ``tied_modules``, a stage's ``tied``), so its parameters are one set however many layers use it."""

    tied_module: nn.Module
    """The shared module (set past nn.Module's registration in __init__)."""

    def __init__(self, key: str, module: nn.Module, *, forward_fn: ForwardFn | None = None,
                 weight_attrs: Sequence[str] = ("weight",)) -> None:
        super().__init__()
        self.tied_key = key
        self.forward_fn = forward_fn
        self.weight_attrs = tuple(weight_attrs)
        object.__setattr__(self, "tied_module", module)     # not a submodule: registered once elsewhere

    def forward(self, x: Any) -> Any:
        module = self.tied_module
        return module(x) if self.forward_fn is None else self.forward_fn(module, x)

    def extra_repr(self) -> str:
        return f"key={self.tied_key!r}, module={type(self.tied_module).__name__}"


def tied_weight(module: nn.Module, attr: str) -> nn.Parameter:
    """``module``'s tied weight named by `attr` (dotted names reach into submodules, as DeepSpeed's
    recursive getattr)."""
    value: Any = module
    for part in attr.split("."):
        value = getattr(value, part, None)
    if not isinstance(value, nn.Parameter):
        raise PipelineError(f"TiedLayerSpec: tied_weight_attr {attr!r} is not a parameter of "
                            f"{type(module).__name__}; name the shared weight (e.g. 'weight')")
    return value


def tied_modules_of(layers: Sequence[nn.Module]) -> dict[str, TiedLayer]:
    """key -> the first `TiedLayer` of that key among ``layers``."""
    found: dict[str, TiedLayer] = {}
    for layer in layers:
        if isinstance(layer, TiedLayer):
            found.setdefault(layer.tied_key, layer)
    return found


def tie_stages(layers: Sequence[nn.Module], chunks: Sequence[range], num_stages: int) -> dict[str, tuple[int, ...]]:
    """key -> the stages holding a use of it, ascending (pure). ``chunks[k]`` are model chunk k's layer indices;
    model chunk k lives on stage k % num_stages."""
    stages: dict[str, set[int]] = {}
    for k, r in enumerate(chunks):
        for i in r:
            layer = layers[i]
            if isinstance(layer, TiedLayer):
                stages.setdefault(layer.tied_key, set()).add(k % num_stages)
    return {key: tuple(sorted(s)) for key, s in sorted(stages.items())}


def shared_parameters(chunks: Sequence[Sequence[tuple[str, nn.Module]]], num_stages: int
                      ) -> dict[str, tuple[tuple[int, ...], nn.Parameter]]:
    """Parameters registered in layers of several stages (e.g. a GPT's tied embedding and lm-head weight):
    the full name of the first use -> (the holding stages, the parameter). ``chunks[k]`` are model chunk k's
    named layers; model chunk k lives on stage k % num_stages. Such a parameter is tied like a tied module's
    weight, as a whole."""
    first: dict[int, tuple[str, nn.Parameter]] = {}
    stages: dict[int, set[int]] = {}
    for k, layers in enumerate(chunks):
        for name, layer in layers:
            for pname, p in layer.named_parameters(remove_duplicate=False):
                first.setdefault(id(p), (f"{name}.{pname}", p))
                stages.setdefault(id(p), set()).add(k % num_stages)
    return {first[i][0]: (tuple(sorted(s)), first[i][1]) for i, s in stages.items() if len(s) > 1}


def build_ties(weights: dict[str, list[nn.Parameter]], sharing: dict[str, tuple[int, ...]], mesh: ParallelMesh,
               ledger: CommLedger) -> TiedParams:
    """``weights``: this stage's tied weights by key. The groups of every key held by more than one stage, one
    per key and per (dp, tp) coordinate over the sharing pp ranks (collective over the world: every rank creates
    every group in the same order, as `dist.new_group` requires), this rank's copies broadcast from the first
    sharing stage, and this rank's `TiedParams`, in key order."""
    shape, here = mesh.shape, mesh.global_rank
    entries: list[TiedParam] = []
    for key, stages in sharing.items():
        if len(stages) < 2:
            continue          # one stage holds every use: autograd already sums them
        mine: Comm | None = None
        for dp in range(shape.dp):
            for tp in range(shape.tp):
                ranks = [shape.rank_of(pp=s, dp=dp, tp=tp) for s in stages]
                group = dist.new_group(ranks)
                if here in ranks:
                    mine = Comm(group, ledger, name=f"pp:tied:{key}")
        if mine is None:
            continue
        with torch.no_grad():
            for w in weights[key]:
                mine.broadcast(w.data, src_group_rank=0)
        first = stages[0] == mesh.rank(Axis.PP)
        entries += [TiedParam(w, mine, counted=first) for w in weights[key]]
    return TiedParams(tuple(entries))


@torch.no_grad()
def synchronize(ties: TiedParams) -> None:
    """Copy the first sharing stage's tied weights to the others (after a checkpoint's weights were loaded)."""
    for t in ties.entries:
        t.comm.broadcast(t.param.data, src_group_rank=0)
