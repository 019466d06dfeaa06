"""`shardwise.zero.Init`: models constructed inside the block are built as ZeRO-3 shards (DeepSpeed's zero.Init).

Inside the block tensors are created on the meta device (shapes only, no memory, no random draws). On exit
each model constructed in it (a module that no other module constructed in it holds) is materialized by
`parallel.zero.materialize.materialize_sharded`: one module at a time, initialized, broadcast from rank 0, cut
to this rank's shards. `shardwise.initialize` under zero_optimization.stage 3 then takes the shards as they are.

How the values are drawn: `init=` (a callable of the model that walks `model.named_modules()` once, touching
each module's own parameters; see materialize.py), else the model's own `init_weights()` when it has one (the
GPT's, which draws exactly what a direct build draws: the same weights under the same seed), else each module's
`reset_parameters()`. Initialization a constructor performs itself is lost on the meta device, so a model that
initializes only in its constructor needs `init=`. Buffers must be set by the init (they are allocated empty).

Build only the model inside the block: every tensor created there is a meta tensor.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_hooks

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.config.resolved import ZeroConfig
from shardwise.parallel.zero.homes import UnitKeeper, mark_homes
from shardwise.parallel.zero.materialize import materialize_sharded
from shardwise.parallel.zero.params import PARTITION_ATTR


class Init:
    """DeepSpeed's `zero.Init(data_parallel_group=None, config_dict_or_path=None, config=None, enabled=True)`
    plus `init=` (see the module docstring). The config (the one given to `initialize`) supplies the
    stage3_*_persistence_threshold values, which must match; the group defaults to the world, which is the
    data-parallel group without tensor or pipeline parallelism (with them, let `initialize` shard the model)."""

    def __init__(self, data_parallel_group: Any = None, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, *, init: Callable[[nn.Module], None] | None = None):
        self.group = data_parallel_group
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        self.enabled = enabled
        self.init = init
        self._hooks: list[Any] = []
        self._device: torch.device | None = None
        self._holders: dict[int, nn.Module] = {}      # modules given parameters or children, first-seen order
        self._held: set[int] = set()                   # modules registered as another module's child

    # -- which modules are built inside --------------------------------------------------------------------
    def _on_param(self, module: nn.Module, name: str, param: Any) -> None:
        self._holders.setdefault(id(module), module)

    def _on_child(self, module: nn.Module, name: str, child: Any) -> None:
        self._holders.setdefault(id(module), module)
        if child is not None:
            self._held.add(id(child))

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        from shardwise.initialization import init_distributed
        init_distributed()                            # DeepSpeed's Init joins the job too: shards need ranks
        self._holders, self._held = {}, set()
        self._hooks = [module_hooks.register_module_parameter_registration_hook(self._on_param),
                       module_hooks.register_module_module_registration_hook(self._on_child)]
        self._device = torch.device("meta")
        self._device.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled:
            return
        self._device.__exit__(exc_type, exc, tb)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if exc_type is not None:
            return
        roots = [m for k, m in self._holders.items() if k not in self._held]
        for model in roots:
            if any(p.device.type == "meta" for p in model.parameters()) and not hasattr(model, PARTITION_ATTR):
                self._materialize(model)

    def _materialize(self, model: nn.Module) -> None:
        zero = self._zero_section()
        comm = Comm(self.group, CommLedger(), name="dp:init")
        materialize_sharded(model, comm=comm, init=self._init_for(model),
                            persistence_threshold=zero.stage3_param_persistence_threshold,
                            model_persistence_threshold=zero.stage3_model_persistence_threshold)
        mark_homes(getattr(model, PARTITION_ATTR), UnitKeeper(comm), comm)

    def _init_for(self, model: nn.Module) -> Callable[[nn.Module], None] | None:
        if self.init is not None:
            return self.init
        if callable(getattr(model, "init_weights", None)):
            return lambda m: m.init_weights()
        return None                                   # materialize's default: each module's reset_parameters

    def _zero_section(self) -> ZeroConfig:
        if self.config is None:
            return ZeroConfig()
        from shardwise.config import load_config_for_world
        # the batch rule's world is every rank (initialize derives dp from it), whatever group shards the model
        return load_config_for_world(self.config, world_size=dist.get_world_size()).zero
