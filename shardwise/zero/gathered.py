"""`shardwise.zero.GatheredParameters`: ZeRO-3 parameters whole inside a block (DeepSpeed's semantics).

    with GatheredParameters(params):                     # read: every rank sees the whole values
    with GatheredParameters(params, modifier_rank=0):    # modify on rank 0: on exit its values are
                                                          # broadcast and cut back into every rank's shards

Collective over the parameters' data-parallel group: every rank enters with the same parameters. Parameters
that are not ZeRO-3 shards (other stages, plain modules) are left alone, so the block is a no-op outside ZeRO-3,
as in DeepSpeed. A unit already gathered (e.g. between a forward and its backward) stays gathered.

After `initialize`, a change reaches training when the optimizer steps the shards themselves (fp32 without
offload); under bf16/fp16 or offload its separate fp32 masters overwrite the shards at the next step.
Difference: DeepSpeed's ZeRO-3 optimizer steps its own fp32 copy in fp32 training too, so there the change
reaches the next forward only and the step overwrites it. Modify weights before `initialize` (as scripts load
them) for the same result in both.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from shardwise.errors import UserError
from shardwise.parallel.zero.homes import HOME_ATTR, ParamHome
from shardwise.parallel.zero.params import ShardedState, Unit


class GatheredParameters:
    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None,
                 fwd_module: Any = None, enabled: bool = True):
        """`fwd_module` is accepted for DeepSpeed's call sites; it registers nothing here (no external
        parameters to track)."""
        self.params = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._homes: list[tuple[torch.Tensor, ParamHome]] = []
        self._gathered: list[tuple[ParamHome, Unit]] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        self._homes = [(p, h) for p in self.params if (h := getattr(p, HOME_ATTR, None)) is not None]
        if self.modifier_rank is not None and self._homes:
            size = self._homes[0][1].comm.size
            if not 0 <= self.modifier_rank < size:
                raise UserError(f"GatheredParameters(modifier_rank={self.modifier_rank}): it must be a rank of the "
                                f"data-parallel group, 0 to {size - 1}")
        seen: set[int] = set()
        for _, home in self._homes:
            u = home.unit
            if u is None or id(u) in seen:
                continue
            seen.add(id(u))
            if u.sharded_state is not ShardedState.UNSHARDED:
                home.keeper.gather_unit(u)
                self._gathered.append((home, u))
        return self

    @torch.no_grad()
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None and self.modifier_rank is not None:
                for p, home in self._homes:
                    home.comm.broadcast(p.data, src_group_rank=self.modifier_rank)
                    if home.flat is not None:
                        home.flat.take(home.index, p.data)
        finally:
            for home, u in self._gathered:
                home.keeper.free_unit(u)
            self._gathered, self._homes = [], []
