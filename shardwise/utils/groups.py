"""DeepSpeed's `deepspeed.utils.groups` expert helpers, for scripts: the ep and expert-data-parallel groups of
each ep size, by DeepSpeed's names ("ep_size_2").

DeepSpeed keeps these in module-level tables and scripts look them up by name, so this module does too: it is
the compatibility surface only. shardwise's own code passes `ExpertGroups` (`parallel/experts/groups.py`), which
is what the tables hold. Without a model-parallel unit the data-parallel group is the world, as in DeepSpeed.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from shardwise.errors import UserError
from shardwise.parallel.experts.groups import ExpertGroups, build_expert_groups

mpu: Any = None
"""DeepSpeed's model-parallel unit slot; shardwise's expert groups do not read it."""

_EXPERT_GROUPS: dict[str, ExpertGroups] = {}


def _create_expert_and_data_parallel(expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False,
                                     **_layout: Any) -> None:
    """The groups of ep size `expert_parallel_size_` over the world, once (later calls for the same size return)."""
    if use_data_before_expert_parallel_:
        raise UserError("use_data_before_expert_parallel_=True is not supported: leave it False (ep groups of "
                        "consecutive ranks)")
    name = f"ep_size_{expert_parallel_size_}"
    if name not in _EXPERT_GROUPS:
        _EXPERT_GROUPS[name] = build_expert_groups(expert_parallel_size_)


def _groups(group_name: str) -> ExpertGroups:
    if group_name not in _EXPERT_GROUPS:
        known = ", ".join(_EXPERT_GROUPS) or "none yet"
        raise UserError(f"no expert groups named {group_name!r} (made: {known}): build the MoE layer with that "
                        f"ep_size first, or call _create_expert_and_data_parallel")
    return _EXPERT_GROUPS[group_name]


def _get_expert_parallel_group(group_name: str) -> dist.ProcessGroup:
    return _groups(group_name).ep_group


def _get_expert_data_parallel_group(group_name: str) -> dist.ProcessGroup:
    return _groups(group_name).expert_dp_group


def _get_expert_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    return {name: g.ep_group for name, g in _EXPERT_GROUPS.items()}


def _get_expert_data_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    return {name: g.expert_dp_group for name, g in _EXPERT_GROUPS.items()}


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_groups(group_name).ep_ranks)


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_groups(group_name).expert_dp_ranks)


def _get_expert_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The world rank of the first member of this rank's ep group."""
    return _groups(group_name).ep_ranks[0]


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_data_parallel_group(group_name))


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The world rank of the first member of this rank's expert-dp group (where its experts' values come from)."""
    return _groups(group_name).expert_dp_ranks[0]


def _get_max_expert_size() -> int:
    """The largest ep size with groups made (1 when none)."""
    return max((g.ep_size for g in _EXPERT_GROUPS.values()), default=1)


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> dist.ProcessGroup:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    """Experts are not split by tensor parallelism here."""
    return 1


def _get_data_parallel_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None, "torch.distributed is not initialized"
    return group


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size()


def _get_data_parallel_rank() -> int:
    return dist.get_rank()


def _get_model_parallel_world_size() -> int:
    return 1


def _get_broadcast_src_rank() -> int:
    return 0
