"""DeepSpeed's `deepspeed.checkpointing` API (re-exported as `shardwise.checkpointing`): activation checkpointing a
model calls itself, and the model-parallel random-number tracker, so a Megatron-DeepSpeed style model that wraps
its own layers runs with the import changed (`import shardwise as deepspeed`).

    configure(mpu_, deepspeed_config=ds_config)   # settings are module state, as DeepSpeed's are
    checkpoint(function, *args)      -> function(*args), its activations dropped and recomputed in backward
    get_cuda_rng_tracker().fork()    -> run on the model-parallel stream (dropout on split activations)
    model_parallel_cuda_manual_seed(seed)
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.parallel.recompute import StoredInputs, checkpoint_function
from shardwise.parallel.tensor_parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, get_cuda_rng_tracker

__all__ = ["MODEL_PARALLEL_RNG", "RNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker",
           "is_configured", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
           "non_reentrant_checkpoint", "partition_activations_in_checkpoint", "profile_sink", "profile_times", "reset",
           "set_num_layers"]

logger = logging.getLogger(__name__)

@dataclass
class Settings:
    """What `configure` set (module state: `configure` is DeepSpeed's contract).

    `partition_activations` keeps 1/t of each stored input on each of the t model-parallel ranks (the input is
    replicated over them) and all-gathers it before the replay (ZeRO-R's P_a); `cpu_checkpointing` keeps stored
    inputs in host memory (pinned on CUDA) and copies them back for the replay; `synchronize` (the config's
    `synchronize_checkpoint_boundary`) synchronizes the device at each checkpoint's start and end; `profile`
    times each checkpoint's forward and replay (`profile_times()`). `contiguous_memory_optimization` /
    `number_checkpoints` are accepted and have no effect: they pre-size one buffer for DeepSpeed's partitions to
    limit allocator fragmentation, which torch's caching allocator already bounds for equal-sized partitions; a
    warning says so once.
    """

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize: bool = False
    profile: bool = False
    group: Comm | None = None
    """The model-parallel group partitions are spread over (None: no partitioning); its collectives are recorded
    in a ledger of this module's own (there is no engine to report them)."""
    configured: bool = False


_settings = Settings()
_times: list[tuple[str, float]] = []
"""("forward" | "replay", seconds) of each checkpointed run with `profile` on: this API's and the engine's."""


# -- random streams ---------------------------------------------------------------------------------

def _model_parallel_rank() -> int:
    return _settings.group.rank if _settings.group is not None else 0


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """The default stream seeded with `seed` (equal on the model-parallel ranks), and the tracker's
    model-parallel stream with seed + 2718 + model-parallel rank (different on each)."""
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + _model_parallel_rank())


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    with get_cuda_rng_tracker().fork():
        torch.manual_seed(seed + 2718 + _model_parallel_rank())


# -- configuration ----------------------------------------------------------------------------------

def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's `configure`: defaults, then the config's "activation_checkpointing" block, then the explicit
    arguments. `mpu_`: an object with get_(tensor_)model_parallel_group() (Megatron's), whose group partitions
    are spread over."""
    global _settings
    s = Settings()
    if deepspeed_config is not None:
        from shardwise.config import parse_config
        block = parse_config(deepspeed_config)[0].activation_checkpointing    # the block alone: no batch rule
        s.partition_activations, s.cpu_checkpointing = block.partition_activations, block.cpu_checkpointing
        s.contiguous_memory_optimization, s.number_checkpoints = (block.contiguous_memory_optimization,
                                                                  block.number_checkpoints)
        s.synchronize, s.profile = block.synchronize_checkpoint_boundary, block.profile
    for name, value in (("partition_activations", partition_activations),
                        ("contiguous_memory_optimization", contiguous_checkpointing),
                        ("number_checkpoints", num_checkpoints), ("cpu_checkpointing", checkpoint_in_cpu),
                        ("synchronize", synchronize), ("profile", profile)):
        if value is not None:
            setattr(s, name, value)
    if s.contiguous_memory_optimization and not s.partition_activations:
        raise ValueError("contiguous_memory_optimization needs partition_activations = true (DeepSpeed's rule)")
    if s.contiguous_memory_optimization and s.number_checkpoints is None:
        raise ValueError("contiguous_memory_optimization needs number_checkpoints (DeepSpeed's rule)")
    if s.contiguous_memory_optimization:
        warnings.warn("activation checkpointing: contiguous_memory_optimization has no effect in shardwise (torch's "
                      "caching allocator reuses the equal-sized partitions); it is accepted", stacklevel=2)
    if mpu_ is not None:
        getter = getattr(mpu_, "get_tensor_model_parallel_group", None) or mpu_.get_model_parallel_group
        s.group = Comm(getter(), CommLedger(), name="tp:checkpointing")
    s.configured = True
    _settings = s


def is_configured() -> bool:
    return _settings.configured


def reset() -> None:
    """Nothing is buffered between checkpoints here (DeepSpeed clears its contiguous buffers)."""


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    _settings.partition_activations = partition_activation


def set_num_layers(nlayers: int) -> None:
    _settings.number_checkpoints = nlayers


def profile_times() -> list[tuple[str, float]]:
    """With `profile`: ("forward" | "replay", seconds) of every checkpointed run since the last call (this API's
    and the engine's policies'); the record is then cleared."""
    out = list(_times)
    _times.clear()
    return out


def profile_sink() -> list[tuple[str, float]]:
    """The list profiled runs append to (the engine hands it to its recomputed blocks)."""
    return _times


# -- the checkpoint function ------------------------------------------------------------------------

def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, keeping only the inputs (per the settings) and replaying it in backward.

    In backward it restores every random stream the forward used (the default generators and the tracker's
    streams, also any tensor-parallel stream of shardwise's own layers), replays the function, and backpropagates
    through the replay. The engine's "activation_checkpointing" policies use the same function when
    `partition_activations` or `cpu_checkpointing` is set (`recompute.py`)."""
    stored = StoredInputs(group=_settings.group if _settings.partition_activations else None,
                          cpu=_settings.cpu_checkpointing, synchronize=_settings.synchronize,
                          times=_times if _settings.profile else None)
    return checkpoint_function(function, args, kwargs, stored)


non_reentrant_checkpoint = checkpoint
