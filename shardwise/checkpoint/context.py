"""What the checkpoint code reads and restores of a training run: a typed context the engine hands over, never
the engine itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.comm.topology import Axis, ParallelMesh
from shardwise.parallel.interfaces import DataParallelRuntime, ShardedState, StageNaming


class Progress(Protocol):
    """The step counters a checkpoint saves, and how a load restores them (the engine's step driver)."""

    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int

    def resume(self, *, global_steps: int, global_samples: int, skipped_steps: int) -> None: ...


@dataclass(frozen=True)
class CheckpointContext:
    module: torch.nn.Module
    """This rank's module: its stage under a pipeline, with TP slices under tensor parallelism."""
    mesh: ParallelMesh
    ledger: CommLedger
    naming: StageNaming
    """This rank's module tensors under the full model's names."""
    state: ShardedState
    """The updater's stepped tensors and optimizer state."""
    dp_runtime: DataParallelRuntime
    """Gathers ZeRO-3 shards for a consolidated state dict; its gradients are zeroed after a load."""
    lr_scheduler: Any
    progress: Progress
    raw_config: dict[str, Any]
    """The config as the user gave it, saved as DeepSpeed's ds_config."""
    zero_stage: int = 0
    """The ZeRO stage: DeepSpeed's file names and optimizer-state format depend on it (its ZeRO-3 model states
    are one file per dp rank; its ZeRO optimizer files hold flat partitions of another shape per stage)."""
    bf16: bool = False
    """Whether the run trains in bf16: DeepSpeed then names the ZeRO optimizer files "bf16_zero_pp_rank_...".
    """
    tag_validation: str = "Warn"
    """DeepSpeed's checkpoint.tag_validation: "Ignore", "Warn" or "Fail" when ranks save under different tags."""

    def comm(self, axis: Axis) -> Comm:
        """The `axis` group for the checkpoint's own small collectives (barriers, agreement, the index)."""
        return self.mesh.comm(axis, self.ledger, name=f"{axis.value}:metrics")

    @property
    def dp_rank(self) -> int:
        return self.mesh.rank(Axis.DP)

    @property
    def dp_size(self) -> int:
        return self.mesh.size(Axis.DP)
