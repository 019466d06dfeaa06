"""shardwise: distributed training of transformer language models on torch.distributed.

Public API (DeepSpeed-compatible):

    import shardwise
    shardwise.init_distributed()
    engine, optimizer, dataloader, lr_scheduler = shardwise.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    for batch in dataloader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

DeepSpeed's other names scripts use: `shardwise.add_config_arguments`, `shardwise.comm` (get_rank, barrier, ...),
`shardwise.zero` (Init, GatheredParameters), `shardwise.ops.adam` (FusedAdam, DeepSpeedCPUAdam),
`shardwise.utils` (safe_get_full_fp32_param, safe_get_full_grad; `utils.groups`, the expert groups) and
`shardwise.moe` (`moe.layer.MoE`, `moe.utils.split_params_into_different_moe_groups_for_optimizer`).

The torch-native way in, for a plain optimizer and loop: `shardwise.fully_shard(block)` per block then on the
model (FSDP2's shape, `MixedPrecisionPolicy`, `CPUOffloadPolicy`), `shardwise.FullyShardedDataParallel(model,
mixed_precision=shardwise.MixedPrecision(...))` (FSDP1's) and `shardwise.DistributedDataParallel(model)`;
`shardwise.get_state_dict` / `set_state_dict` save and resume them (model and optimizer, full or sharded);
`shardwise.parallelize_module(model, mesh["tp"], plan)` splits a model over a (dp, tp) DeviceMesh's tp dimension
before `fully_shard(..., mesh=mesh["dp"])`, as torchtitan composes them.

Names are resolved lazily so that torch-free parts (the planner) can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "initialize": "shardwise.engine.initialize",
    "init_distributed": "shardwise.comm.dist_api",
    "Engine": "shardwise.engine.engine",
    "DeepSpeedEngine": "shardwise.engine.engine",
    "PipelineEngine": "shardwise.engine.engine",
    "load_config": "shardwise.config",
    "ConfigError": "shardwise.config",
    "DeepSpeedConfigError": "shardwise.config",
    "ConfigWarning": "shardwise.config",
    "AutoValues": "shardwise.config",
    "UserError": "shardwise.errors",
    "add_config_arguments": "shardwise.engine.arguments",
    # the torch-native way in: module wrappers over the same strategies
    "fully_shard": "shardwise.parallel.wrappers",
    "FSDPModule": "shardwise.parallel.wrappers",
    "FullyShardedDataParallel": "shardwise.parallel.wrappers",
    "DistributedDataParallel": "shardwise.parallel.wrappers",
    "MixedPrecisionPolicy": "shardwise.parallel.wrappers",
    "MixedPrecision": "shardwise.parallel.wrappers",
    "CPUOffloadPolicy": "shardwise.parallel.wrappers",
    "CPUOffload": "shardwise.parallel.wrappers",
    "OffloadPolicy": "shardwise.parallel.wrappers",
    "get_state_dict": "shardwise.parallel.wrappers",
    "set_state_dict": "shardwise.parallel.wrappers",
    "parallelize_module": "shardwise.models.parallelize",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in ("models", "planner", "data", "comm", "testing", "pipe", "checkpointing", "zero", "ops",
                "utils", "runtime", "moe", "sequence"):
        return importlib.import_module(f"shardwise.{name}")
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
