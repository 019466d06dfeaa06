"""DeepSpeed's `deepspeed.moe.utils`: which parameters are experts', and the optimizer's param groups split so
each group holds either expert or other parameters (as DeepSpeed's ZeRO needs; shardwise reduces each parameter
over its own group whatever the param groups, so the split only changes how the optimizer groups them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.errors import UserError

DEEPSPEED_MAX_GROUP_SIZE = 178956971
"""DeepSpeed's default largest MoE param group, in elements."""


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether `param` belongs to an expert (DeepSpeed's mark: `allreduce = False`)."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether `m` holds a DeepSpeed-style MoE layer, the experts of the first one)."""
    from shardwise.moe.layer import MoE
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def split_params_into_shared_and_expert_params(
        params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(
        group: list[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shared = [p.grad.to(p.dtype) for p in group if p.grad is not None and not is_moe_param(p)]
    return shared, [p.grad.to(p.dtype) for p in group if p.grad is not None and is_moe_param(p)]


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
        max_group_size: int | float | None = DEEPSPEED_MAX_GROUP_SIZE) -> list[dict[str, Any]]:
    """DeepSpeed's rule: each group keeps its other parameters; its expert parameters move to new groups, one per
    (group, expert group name), with the group's options, `name` = the expert group's name and `moe` = True,
    cut into groups of at most `max_group_size` elements. Every group needs a `name` (DeepSpeed's requirement)."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for g in groups:
        if "name" not in g:
            raise UserError("split_params_into_different_moe_groups_for_optimizer: every param group needs a "
                            "'name' key (DeepSpeed's rule); add one, e.g. {'params': ..., 'name': 'dense'}")
    names = list(dict.fromkeys(p.group_name for g in groups for p in g["params"] if is_moe_param(p)))
    moved: list[dict[str, Any]] = []
    for g in groups:
        params = list(g["params"])
        g["params"] = [p for p in params if not is_moe_param(p)]
        for name in names:
            mine = [p for p in params if is_moe_param(p) and p.group_name == name]
            for chunk in _chunks(mine, max_group_size):
                moved.append({**g, "name": name, "moe": True, "params": chunk})
    return groups + moved


def _chunks(params: list[nn.Parameter], limit: int | float | None) -> list[list[nn.Parameter]]:
    if limit is None:
        return [params]
    out: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        n = p.numel()
        if current and size + n > limit:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += n
    if current:
        out.append(current)
    return out


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list) -> list[dict[str, Any]]:
    """DeepSpeed's: a list of parameters becomes a 'dense-params' group split as above; a list of groups is split
    unless one already says 'moe'."""
    first = model_parameters[0]
    if isinstance(first, torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                     "name": "dense-params"})
    if not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
