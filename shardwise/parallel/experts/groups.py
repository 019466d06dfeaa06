"""The process groups of expert parallelism, built from a list of data-parallel ranks.

The ranks are split into ep groups of `ep_size` consecutive ranks (the tokens of an ep group are exchanged among
its members); the ranks at the same place of every ep group form an expert-data-parallel group (they hold the
same experts, and reduce those experts' gradients together). DeepSpeed's default layout:

    ranks 0..7, ep_size 2:  ep groups [0, 1] [2, 3] [4, 5] [6, 7];  expert-dp groups [0, 2, 4, 6] [1, 3, 5, 7]

Every rank creates every group, in one order (torch.distributed's `new_group` is collective over the world).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

from shardwise.errors import UserError
from shardwise.parallel.replicas import ReplicaGroup


@dataclass(frozen=True, eq=False)
class ExpertGroups:
    """This rank's two groups for one ep size."""

    ep_size: int
    ep_group: dist.ProcessGroup
    ep_ranks: tuple[int, ...]
    expert_dp_group: dist.ProcessGroup
    expert_dp_ranks: tuple[int, ...]

    @property
    def name(self) -> str:
        """DeepSpeed's name of the groups of this ep size."""
        return f"ep_size_{self.ep_size}"

    @property
    def replicas(self) -> ReplicaGroup:
        """What an expert's parameters are marked with: the ranks holding the same experts."""
        return ReplicaGroup(self.expert_dp_group, self.name)


def expert_layout(ranks: Sequence[int], ep_size: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(ep groups, expert-dp groups) of `ranks`, pure. One line naming both numbers when ep_size does not divide."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise UserError(f"ep_size = {ep_size!r}: pass a positive integer")
    n = len(ranks)
    if n % ep_size:
        raise UserError(f"ep_size = {ep_size} does not divide the {n} data-parallel ranks: the ranks are split into "
                        f"expert-parallel groups of ep_size; choose an ep_size dividing {n}")
    ep_groups = [tuple(ranks[i:i + ep_size]) for i in range(0, n, ep_size)]
    expert_dp = [tuple(ranks[j::ep_size]) for j in range(ep_size)]
    return ep_groups, expert_dp


def build_expert_groups(ep_size: int, ranks: Sequence[int] | None = None) -> ExpertGroups:
    """This rank's ep and expert-dp groups over `ranks` (default: the world). Collective over the world."""
    if not dist.is_initialized():
        raise UserError(f"expert parallelism (ep_size = {ep_size}) needs torch.distributed: call "
                        f"shardwise.init_distributed() before building the model")
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    return build_expert_groups_over(ep_size, [ranks])


def build_expert_groups_over(ep_size: int, dp_groups: Sequence[Sequence[int]]) -> ExpertGroups:
    """This rank's ep and expert-dp groups, each data-parallel group in `dp_groups` (every one of the run, listed
    alike on every rank) split by `expert_layout`. Collective over the world: every rank creates every group."""
    me = dist.get_rank()
    mine_dp = mine_ep = None
    for ranks in dp_groups:
        ep_groups, expert_dp = expert_layout(list(ranks), ep_size)
        for members in expert_dp:          # DeepSpeed's order: the expert-dp groups first
            group = dist.new_group(list(members))
            if me in members:
                mine_dp = (group, members)
        for members in ep_groups:
            group = dist.new_group(list(members))
            if me in members:
                mine_ep = (group, members)
    if mine_dp is None or mine_ep is None:
        raise UserError(f"rank {me} is not among the ranks {[list(g) for g in dp_groups]} given for expert "
                        f"parallelism")
    return ExpertGroups(ep_size, mine_ep[0], mine_ep[1], mine_dp[0], mine_dp[1])
