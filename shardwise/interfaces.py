"""The three interfaces the engine calls. `initialize` picks one object of each kind once; the engine and the
checkpoint code never ask which strategy is behind them.

    DataParallelRuntime   around forward/backward across dp ranks: gradient all-reduce (stage 0) or
                          reduce-scatter (ZeRO 1-2), and under ZeRO-3 gathering and freeing parameters
    Updater               turns synchronised gradients into new parameters: unscale, overflow, clip, step
    Pipeline              how a global batch runs: the whole model on every rank (`SingleStage`), or this
                          rank's stage under a schedule (`PipelineRunner`); also how a stage's tensors are named
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol

import torch

if TYPE_CHECKING:
    from shardwise.engine import Engine
    from shardwise.parallel.tied import TiedParams
    from shardwise.parallel.update import Piece
    from shardwise.parallel.zero.build import ShardingUnits
    from shardwise.precision import LossScaler
    from shardwise.parallel.grad_norm import Riders


class DataParallelRuntime(Protocol):
    """`BucketedAllReduce` (stage 0), `ZeroGradReducer` (stages 1-2), `ZeroParamRuntime` (stage 3)."""

    @property
    def grad_bytes(self) -> int:
        """Bytes of gradient buffers this rank holds."""
        ...

    def begin_backward(self, boundary: bool) -> None:
        """Before a backward; `boundary`: the last micro-batch of a global batch."""

    def end_backward(self, boundary: bool) -> None:
        """After a backward: on the boundary every gradient is synchronised when this returns."""

    def zero_grad(self) -> None: ...

    def param_storage_keys(self) -> set[int]:
        """Storages of parameter buffers gathered meanwhile (not activations, for the activation meter)."""
        ...

    def gathered_state_dict(self, module: torch.nn.Module, *, rank0_only: bool = True
                            ) -> dict[str, torch.Tensor] | None:
        """`module`'s state dict with every dp shard in place (collective over dp); None on dp ranks other
        than 0 when `rank0_only`."""
        ...

    def release_gathered(self) -> None:
        """Free every parameter buffer gathered from other ranks (ZeRO-3; nothing elsewhere)."""

    def close(self) -> None: ...


class Updater(Protocol):
    """`ReplicatedUpdate` (stage 0), `ShardedUpdate` (1-2), `Stage3Update`; all share `parallel.update.Update`."""

    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    last_grad_norm: float | None
    checkpoint_per_rank: bool
    model_params: list[torch.nn.Parameter]
    """The model's parameters this updater trains (what `shardwise.utils` reads values of)."""
    stepped: list[torch.nn.Parameter]
    """What the optimizer steps: the model's parameters, or fp32 masters (whole, or ZeRO shards)."""

    def step(self, riders: Riders | None = None) -> bool:
        """The update; False when an overflow skipped it (on every rank alike). `riders`: device metrics (the
        train_batch loss) summed over their group and read with the step's one host read."""
        ...

    def zero_master_grads(self) -> None: ...

    def param_bytes(self) -> int: ...

    def state_bytes(self) -> int: ...

    def staging_bytes(self) -> int:
        """Host buffers that only stage offload's copies (pinned, allocated once): not model states."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict, *, load_optimizer_states: bool = True) -> None: ...

    def sync_masters_from_model(self) -> None:
        """After loading module weights only: restart what the optimizer steps from them."""

    def pieces(self) -> list[list[Piece]]:
        """Per stepped tensor: which parts of which parameters it holds (a checkpoint's layout index)."""
        ...

    def slots(self) -> list[tuple[int, int | None]]:
        """Per stepped tensor: where `state_dict()` keeps its optimizer state and its master."""
        ...

    def group_options(self) -> list[dict]:
        """Per stepped tensor: its param group's options."""
        ...

    def load_stepped(self, values: list[torch.Tensor | None], states: list[dict] | None,
                     options: list[dict] | None, scaler: dict | None) -> None:
        """Load values (and optimizer states) assembled for this layout, then publish them to the model."""

    def full_master(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 value the optimizer steps for `param` (one of `model_params`), whole. Collective over dp
        when dp ranks hold shards."""
        ...

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """`param`'s gradient as the next step will use it (averaged over dp once synchronised), whole.
        Collective over dp when dp ranks hold shards."""
        ...


class Pipeline(Protocol):
    """`SingleStage` (pipeline.stages = 1) or `PipelineRunner`."""

    reads_in_order: bool
    """Whether `initialize(training_data=...)` is read in order (DeepSpeed's PipelineEngine) or shuffled."""

    def owned(self, model_parameters: Iterable[Any]) -> list[Any]:
        """`model_parameters` (tensors or param-group dicts of the full model) restricted to this rank's."""
        ...

    def blocks(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """This rank's transformer blocks, in forward order (what activation recomputation wraps)."""
        ...

    def sharding_units(self) -> ShardingUnits | None:
        """How ZeRO-3 should cut this rank's module (None: its own default)."""
        ...

    def tied_params(self) -> TiedParams:
        """This rank's copies of weights other stages hold too, whose gradients the updater sums."""
        ...

    def train_batch(self, engine: Engine, data_iter: Iterator[Any] | None) -> float:
        """One global batch and one optimizer step; the mean loss, equal on every rank."""
        ...

    def eval_batch(self, engine: Engine, data_iter: Iterator[Any] | None, count: int) -> float:
        """`count` micro-batches forward only; the mean loss, equal on every rank."""
        ...

    def refuse_manual_step(self, what: str) -> None:
        """Raise if `engine(batch)` / `engine.backward` cannot be called directly (a schedule owns them)."""

    def module_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's module states under the full model's names (so a checkpoint reloads into other stages)."""
        ...

    def load_module_state(self, module: torch.nn.Module, full: dict[str, Any], strict: bool) -> None:
        """Load this rank's part of a state dict keyed by the full model's names."""

    def full_names(self, module: torch.nn.Module) -> dict[str, str]:
        """This rank's module state-dict keys -> the full model's keys."""
        ...

    def gather_stages(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Every stage's `local` state (module names) merged under full names on stage 0; None elsewhere.
        Collective over the pipeline."""
        ...

    def close(self) -> None: ...
