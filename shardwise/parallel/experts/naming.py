"""Experts under the whole model's names, so a checkpoint holds each expert once and loads at another ep size.

Under expert parallelism ep rank r of an MoE layer with E experts holds experts r * E/ep .. (r + 1) * E/ep - 1 as
its local experts 0 .. E/ep - 1: two ranks hold different tensors under the same module name. Checkpoints name
them by their global index instead (DeepSpeed's rule for its expert files):

    ep 2, rank 1:  blocks.1.mlp.experts.0.fc.weight  ->  blocks.1.mlp.experts.2.fc.weight

`ExpertNaming` wraps a stage's naming (`StageNaming`) with that renaming; `expert_places` says, per local state
key, which MoE layer (counted in module order, as DeepSpeed counts its MoE layers) and which global expert it
belongs to, for the checkpoint's per-expert files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.parallel.experts.layer import MoELayer
from shardwise.parallel.interfaces import StageNaming


@dataclass(frozen=True)
class ExpertPlace:
    layer: int
    """The MoE layer's number among the model's MoE layers, in module order."""
    expert: int
    """The expert's global index in its layer."""


def _expert_prefixes(module: nn.Module) -> dict[str, tuple[str, ExpertPlace]]:
    """Local key prefix of each local expert ("blocks.1.mlp.experts.0.") -> (its global prefix, its place)."""
    out: dict[str, tuple[str, ExpertPlace]] = {}
    layer_id = 0
    for path, layer in module.named_modules():
        if not isinstance(layer, MoELayer):
            continue
        inside = {id(m): n for n, m in layer.named_modules()}
        base = f"{path}." if path else ""
        for i, expert in enumerate(layer.local_experts()):
            rel = inside[id(expert)]                 # "experts.0" (ours) or "experts.deepspeed_experts.0"
            head, _, index = rel.rpartition(".")
            if index != str(i):
                raise ValueError(f"MoE layer {path!r}: local expert {i} is registered as {rel!r}; expected its "
                                 f"name to end in .{i}")
            glob = f"{head}.{layer.first_expert + i}" if head else str(layer.first_expert + i)
            out[f"{base}{rel}."] = (f"{base}{glob}.", ExpertPlace(layer_id, layer.first_expert + i))
        layer_id += 1
    return out


def expert_places(module: nn.Module) -> dict[str, ExpertPlace]:
    """This rank's expert tensors: local state key -> its MoE layer and global expert."""
    prefixes = _expert_prefixes(module)
    out = {}
    for key in module.state_dict(keep_vars=True):
        for local, (_, place) in prefixes.items():
            if key.startswith(local):
                out[key] = place
    return out


class ExpertNaming:
    """`inner`'s names with every local expert renamed to its global index (a `StageNaming`)."""

    def __init__(self, inner: StageNaming) -> None:
        self.inner = inner

    def _renamed(self, module: nn.Module) -> dict[str, tuple[str, str]]:
        """Local key -> (inner full name, full name here) for every expert tensor of `module`."""
        prefixes = _expert_prefixes(module)
        inner = self.inner.full_names(module)
        out = {}
        for key, full in inner.items():
            for local, (glob, _) in prefixes.items():
                if key.startswith(local):
                    rest = key[len(local):]
                    tail = local + rest
                    # The inner naming may prefix a stage's names; the expert's part is the key's tail.
                    out[key] = (full, full[:len(full) - len(tail)] + glob + rest)
        return out

    def full_names(self, module: nn.Module) -> dict[str, str]:
        renamed = self._renamed(module)
        return {k: renamed[k][1] if k in renamed else v for k, v in self.inner.full_names(module).items()}

    def module_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        outer = {inner: full for inner, full in self._renamed(module).values()}
        return {outer.get(k, k): v for k, v in self.inner.module_state_dict(module).items()}

    def load_module_state(self, module: nn.Module, full: dict[str, Any], strict: bool) -> None:
        renamed = self._renamed(module)
        back = {glob: inner for inner, glob in renamed.values()}
        # A key that is one of this rank's inner expert names but not its global one names another rank's
        # expert (global expert 1 vs local expert 1): never loaded here.
        others = {inner for inner, _ in renamed.values()} - set(back)
        self.inner.load_module_state(module, {back.get(k, k): v for k, v in full.items() if k not in others},
                                     strict)

    def gather_stages(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        return self.inner.gather_stages(local)


def with_expert_names(module: nn.Module, naming: StageNaming) -> StageNaming:
    """`naming`, renaming experts to their global index when `module` has MoE layers."""
    if not any(isinstance(m, MoELayer) for m in module.modules()):
        return naming
    return ExpertNaming(naming)
