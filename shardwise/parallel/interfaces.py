"""The interfaces between the engine and the strategies. `shardwise.engine.initialize` builds one object of each
kind once; the engine, the checkpoint code and DeepSpeed's helpers each hold the narrow view they call and never
ask which strategy is behind it.

Strategies implement these structurally (no inheritance): `UpdateStrategy` (`Updater` + `ShardedState` +
`FullValues`) and `Pipeline` (`BatchSchedule` + `StageNaming` + `StageBuild`) name the whole object a builder
returns; `DataParallelRuntime` runs around backward, and `StepDriver` is what a `BatchSchedule` drives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Iterator, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from shardwise.comm.ledger import CommLedger
    from shardwise.parallel.grad_norm import ExtraSums
    from shardwise.parallel.precision import LossScaler
    from shardwise.parallel.tied import TiedParams
    from shardwise.parallel.zero.build import ShardingUnits


@runtime_checkable
class RecordsCollectives(Protocol):
    """A module that runs collectives of its own in forward and backward (an MoE layer's all-to-alls), over groups
    it was given: `initialize` hands it the engine's ledger, so they are in `comm_report()`, the hang reports and
    the desync check like every other collective."""

    def record_into(self, ledger: CommLedger) -> None: ...


class DataParallelRuntime(Protocol):
    """Around backward across dp ranks: gradient all-reduce (stage 0, `BucketedAllReduce`), reduce-scatter
    (stages 1-2, `ZeroGradReducer`), under ZeRO-3 also gathering and freeing parameters (`ZeroParamRuntime`)."""

    @property
    def grad_bytes(self) -> int:
        """Bytes of gradient buffers this rank holds."""
        ...

    @property
    def accumulates_locally(self) -> bool:
        """Whether a backward may keep its gradients on this rank until a later one communicates them (DeepSpeed's
        no_sync): False where gradients are partitioned as they are produced (ZeRO 2 and 3)."""
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


@dataclass(frozen=True)
class HeldBytes:
    """What an updater holds on this rank, in bytes."""

    params: int
    """The model's parameters as this rank holds them (whole, or ZeRO-3 shards)."""
    optimizer: int
    """Optimizer states, separate fp32 masters included (the ZeRO paper's K * psi)."""
    staging: int
    """Host buffers that only stage offload's copies (pinned, allocated once): not model states."""


class Updater(Protocol):
    """The step the engine takes on a gradient-accumulation boundary: synchronised gradients -> new parameters
    (unscale, overflow, clip, step). `ReplicatedUpdate` (stage 0), `ShardedUpdate` (1-2), `Stage3Update`; all
    share `parallel.update.Update`."""

    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    last_grad_norm: float | None

    def step(self, extra: ExtraSums | None = None) -> bool:
        """The update; False when an overflow skipped it (on every rank alike). `extra`: device metrics (the
        train_batch loss) summed over their group and read with the step's one host read."""
        ...

    def zero_master_grads(self) -> None: ...

    def held_bytes(self) -> HeldBytes: ...


@dataclass(frozen=True, eq=False)
class Piece:
    """Part of one parameter held by a stepped tensor: elements [lo, hi) of the parameter flattened (this
    rank's TP slice of it, `shape`) sit at [dst, dst + hi - lo) of the stepped tensor."""

    param: torch.nn.Parameter
    shape: tuple[int, ...]
    lo: int
    hi: int
    dst: int


@dataclass(frozen=True, eq=False)
class SteppedEntry:
    """One tensor the optimizer steps, as a checkpoint indexes it."""

    pieces: list[Piece]
    """The parameter pieces it holds."""
    optimizer_index: int
    """Its index in `optimizer.state_dict()["state"]` (torch numbers the groups' parameters in order)."""
    master_index: int | None
    """Its index in the updater's `state_dict()["masters"]`; None: it is the model's own parameter, whose value
    the module states hold."""
    options: dict[str, Any]
    """Its param group's options (lr, betas, ...), without the params."""


class ShardedState(Protocol):
    """The updater as a checkpoint sees it: what each rank holds and how to put it back (the stepped tensors,
    whole or this rank's shards, their optimizer state and where each piece of a parameter sits)."""

    checkpoint_per_rank: bool
    """Whether each rank saves its own optimizer state (ZeRO shards) or dp rank 0 saves everyone's (replicated)."""
    stepped: list[torch.nn.Parameter]
    """What the optimizer steps: the model's parameters, or fp32 masters (whole, or ZeRO shards)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], *, load_optimizer_states: bool = True) -> None:
        """Load a `state_dict()` written at this very layout."""

    def state_dict_mismatch(self, state: dict[str, Any]) -> str | None:
        """Why `load_state_dict(state)` would refuse `state` (written by another data-parallel size or ZeRO
        stage), in one line naming the fix; None when it takes it. Changes nothing."""
        ...

    def sync_masters_from_model(self) -> None:
        """After loading module weights only: restart what the optimizer steps from them."""

    def entries(self) -> list[SteppedEntry]:
        """Per stepped tensor (the order of `stepped`): its pieces, optimizer slot, master slot and options."""
        ...

    def load_stepped(self, values: Sequence[torch.Tensor | None], states: Sequence[dict[str, Any]] | None,
                     options: Sequence[dict[str, Any]] | None, scaler: dict[str, Any] | None) -> None:
        """Load values (and optimizer states) assembled for this layout, then publish them to the model."""


class FullValues(Protocol):
    """A trained parameter's values as DeepSpeed's `safe_get_full_fp32_param` / `safe_get_full_grad` give them."""

    model_params: list[torch.nn.Parameter]
    """The model's parameters this updater trains."""

    def full_master(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 value the optimizer steps for `param` (one of `model_params`), whole. Collective over dp
        when dp ranks hold shards."""
        ...

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """`param`'s gradient as the next step will use it (averaged over dp once synchronised), whole.
        Collective over dp when dp ranks hold shards."""
        ...

    def full_shape(self, param: torch.nn.Parameter) -> tuple[int, ...]:
        """`param`'s shape whole as this rank trains it (its TP slice), also where this rank holds none of it."""
        ...

    def stepped_grads(self) -> list[torch.Tensor | None]:
        """Per stepped tensor (the order of `ShardedState.stepped`): the gradient the next step reads for it, laid
        out as that tensor (a ZeRO gradient shard, a parameter's .grad); None where there is none yet."""
        ...

    def sum_over_shards(self, t: torch.Tensor, param: torch.nn.Parameter) -> None:
        """Sum `t` in place over the ranks that hold shards of `param` (dp under ZeRO 1-3; an expert's expert-dp
        group); nothing where each rank holds it whole."""


class UpdateStrategy(Updater, ShardedState, FullValues, Protocol):
    """What `build_replicated` / `build_zero` return: one object behind the three views."""


class StepDriver(Protocol):
    """What a `BatchSchedule` drives (the engine's step counting, gradient sync and update). A plain loop calls
    `forward`, `backward` and `step` per micro-batch; a pipeline schedule runs the micro-batches itself between
    `open_step` and `complete_global_batch`."""

    @property
    def micro_batches(self) -> int:
        """Micro-batches per global batch (gradient_accumulation_steps)."""
        ...

    @property
    def loss_scale(self) -> float: ...

    @property
    def dp_runtime(self) -> DataParallelRuntime: ...

    def forward(self, *inputs: Any, **kwargs: Any) -> Any: ...

    def backward(self, loss: torch.Tensor) -> torch.Tensor: ...

    def backward_seed(self, scaled: torch.Tensor, loss: torch.Tensor) -> torch.Tensor | None:
        """The gradient a schedule's loss backward starts from, for the scaled loss `scaled` of the loss function's
        value `loss` (None: torch's 1): nan for an inf/nan loss when such steps are skipped."""
        ...

    def step(self) -> None:
        """Count a micro-batch; on the boundary, the update."""

    def step_agreeing_loss(self, loss_mean: torch.Tensor) -> float:
        """The boundary step, with this rank's mean micro-batch loss (a device scalar) agreed over dp in the
        step's own read; the mean over micro-batches and ranks, the same on every rank."""
        ...

    def local_micro_batch(self, batch: Any) -> Any:
        """This rank's part of a schedule's micro-batch (inputs, labels): with context parallelism its tokens of
        every sequence (`BatchPart`), else the batch as it is."""
        ...

    def open_step(self) -> None:
        """A global batch begins (a schedule's, before its first forward)."""

    def stage_forwards(self) -> ContextManager[Any]:
        """Around a schedule's forwards: yields what wraps micro-batch m's forward (a profiler's), or None."""
        ...

    def complete_global_batch(self, *, micro_batches: int, activation_bytes: int) -> None:
        """A schedule ran a whole global batch's forwards and backwards: count them, take the step, keep the
        activation bytes its meter measured."""


class BatchSchedule(Protocol):
    """How a global batch runs: `SingleStage` (the whole model) or `PipelineRunner` (this rank's stage)."""

    # Read-only capabilities (an implementation may make them class constants).
    @property
    def reads_in_order(self) -> bool:
        """Whether `initialize(training_data=...)` is read in order (DeepSpeed's PipelineEngine) or shuffled."""
        ...

    @property
    def fixed_micro_batches(self) -> bool:
        """Whether the micro-batches per global batch were fixed at build time (a schedule was built for them)."""
        ...

    def train_batch(self, driver: StepDriver, data_iter: Iterator[Any] | None) -> float:
        """One global batch and one optimizer step; the mean loss, equal on every rank."""
        ...

    def eval_batch(self, driver: StepDriver, data_iter: Iterator[Any] | None, count: int) -> float:
        """`count` micro-batches forward only; the mean loss, equal on every rank."""
        ...

    def refuse_manual_step(self, what: str) -> None:
        """Raise if `engine(batch)` / `engine.backward` cannot be called directly (a schedule owns them)."""

    def close(self) -> None: ...


class StageNaming(Protocol):
    """This rank's module tensors under the full model's names, so a checkpoint reloads into other stages."""

    def module_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's module states under the full model's names."""
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


class StageBuild(Protocol):
    """What construction asks of the pipeline once, before the data-parallel strategy exists: this rank's
    parameters, blocks, units and ties."""

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


class Pipeline(BatchSchedule, StageNaming, StageBuild, Protocol):
    """What the pipeline builder returns: one object behind the three views."""
