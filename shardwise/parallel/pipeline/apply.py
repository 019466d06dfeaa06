"""Pipeline parallelism inside the engine: split the model for this rank and run `engine.train_batch` /
`engine.eval_batch` through the schedule (`PipelineRunner`, the `interfaces.Pipeline` when pipeline.stages > 1).

    runner = apply_pipeline(model, section=cfg.pipeline, num_microbatches=M, mesh=mesh, ledger=ledger,
                            device=device)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.config import PipelineConfig
from shardwise.errors import CheckpointError, UserError
from shardwise.parallel.pipeline.runtime import PipelineRuntime, StepResult
from shardwise.parallel.pipeline.stage import PipelineStage, release_unowned, split_model
from shardwise.parallel.pipeline.tied import build_ties, synchronize
from shardwise.parallel.tied import TiedParams
from shardwise.parallel.zero.build import ShardingUnits
from shardwise.comm.topology import Axis, ParallelMesh

if TYPE_CHECKING:
    from shardwise.parallel.interfaces import StepDriver


@dataclass
class PipelineRunner:
    """This rank's stage, its runtime and its groups. The whole model's gradient norm and overflow verdict
    across stages come from the update's `GradNormReducer`, like every other part of the model held elsewhere."""

    stage: PipelineStage
    runtime: PipelineRuntime
    pp_comm: Comm
    """This rank's pipeline (group rank = stage)."""
    dp_metrics: Comm
    """The stage's dp group, for the loss average."""
    ties: TiedParams = TiedParams()
    """This stage's copies of weights tied across stages, with the groups of the stages sharing them."""
    last: StepResult | None = None
    """The last step's result: its loss, peak in-flight micro-batches and per-action trace (for timelines)."""
    reads_in_order: ClassVar[bool] = True      # DeepSpeed's PipelineEngine reads its training data in order
    fixed_micro_batches: ClassVar[bool] = True  # the runtime's programs were built for its micro-batch count

    def owned(self, model_parameters: Iterable[Any]) -> list[Any]:
        """``model_parameters`` (tensors or param-group dicts, from the full model) restricted to this stage's."""
        mine = {id(p) for p in self.stage.parameters()}
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            return [dict(g, params=[p for p in g["params"] if id(p) in mine]) for g in items]
        return [p for p in items if id(p) in mine]

    def blocks(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        return self.stage.blocks()

    def tied_params(self) -> TiedParams:
        return self.ties

    def _saved_elsewhere(self, full_name: str) -> bool:
        """A tied module's tensor that an earlier stage holds too: checkpoints keep the first sharing stage's copy."""
        for key, stages in self.stage.tie_stages.items():
            if full_name.startswith(f"tied_modules.{key}.") and stages[0] != self.stage.stage:
                return True
        return False

    def sharding_units(self) -> ShardingUnits:
        """ZeRO-3 under a pipeline: the runtime calls model chunks, not the stage, so each chunk is a root (one
        whole forward) and each of its layers a unit."""
        chunks = self.stage.chunks
        return ShardingUnits(roots=list(chunks), units=[(f"chunks.{v}.layers.{j}", layer)
                                                        for v, chunk in enumerate(chunks)
                                                        for j, layer in enumerate(chunk.layers)])

    def _read(self, data_iter: Iterator[Any] | None, num_micro: int, what: str) -> list[Any] | None:
        """The step's micro-batches on a stage holding the first or last layers (None elsewhere: middle stages
        read nothing, as in DeepSpeed)."""
        if not self.stage.reads_data:
            return None
        if data_iter is None:
            raise UserError(f"{what}(data_iter): pipeline stage {self.stage.stage} holds the first or last layers and "
                            f"reads {num_micro} micro-batches (inputs, labels) per step from data_iter; pass an "
                            f"iterator (or initialize(training_data=...) for train_batch())")
        return [next(data_iter) for _ in range(num_micro)]

    def train_batch(self, driver: StepDriver, data_iter: Iterator[Any] | None) -> float:
        """One global batch through the pipeline and one optimizer step; the mean loss on every rank.

        The first and last stages read M = gradient_accumulation_steps micro-batches ``(inputs, labels)`` from
        ``data_iter`` (the middle stages read nothing, as in DeepSpeed); the runtime runs the schedule (the last
        stage's loss / M starts each backward, times the fp16 loss scale, seeded by the driver's `backward_seed`:
        an inf/nan loss poisons its gradients, so the step is skipped as with one stage); gradients are
        synchronised over dp during the stage's last backward; the optimizer steps this stage's parameters. The
        step's loss (mean over micro-batches) is broadcast from the last stage and averaged over the dp replicas."""
        num_micro = self.runtime.num_microbatches
        micro = self._read(data_iter, num_micro, "engine.train_batch")
        if micro is not None:          # with context parallelism: this rank's tokens of each sequence
            micro = [driver.local_micro_batch(mb) for mb in micro]
        driver.open_step()
        self.stage.train()
        with driver.stage_forwards() as around_forward:
            result = self.runtime.step(micro, loss_scale=driver.loss_scale, dp_runtime=driver.dp_runtime,
                                       around_forward=around_forward, backward_seed=driver.backward_seed)
        self.last = result
        loss = self._agreed_mean(result.losses)
        driver.complete_global_batch(micro_batches=num_micro, activation_bytes=result.peak_activation_bytes)
        return loss

    def eval_batch(self, driver: StepDriver, data_iter: Iterator[Any] | None, count: int) -> float:
        """``count`` micro-batches forward only (`PipelineRuntime.evaluate`; the engine has put the module in
        eval mode; any count, any shapes), with no gradient, no synchronisation and no step; the mean loss on
        every rank, agreed like `train_batch`'s."""
        micro = self._read(data_iter, count, "engine.eval_batch")
        if micro is not None:
            micro = [driver.local_micro_batch(mb) for mb in micro]
        return self._agreed_mean(self.runtime.evaluate(micro, num_microbatches=count))

    def _agreed_mean(self, losses: list[float]) -> float:
        """The mean of the last stage's micro-batch losses (``losses`` is empty elsewhere), broadcast along the
        pipeline and averaged over the dp replicas: the same number on every rank."""
        loss = torch.tensor([sum(losses) / len(losses) if losses else 0.0], dtype=torch.float32,
                            device=self.runtime.device)
        self.pp_comm.broadcast(loss, src_group_rank=self.stage.num_stages - 1)
        self.dp_metrics.all_reduce(loss)
        return float(loss) / self.dp_metrics.size

    def refuse_manual_step(self, what: str) -> None:
        raise UserError(f"{what} is not available with pipeline.stages = {self.stage.num_stages}: "
                        f"train with engine.train_batch(data_iter)")

    def module_state_dict(self, module: torch.nn.Module) -> dict[str, Tensor]:
        return {k: v for k, v in self.stage.full_state_dict().items() if not self._saved_elsewhere(k)}

    def load_module_state(self, module: torch.nn.Module, full: dict[str, Any], strict: bool) -> None:
        """This stage's tensors from ``full``; tied weights then come from the first stage sharing them
        (collective over those stages), whose file alone has them."""
        names = self.stage.full_names()           # local name -> full name
        local = {k: full[f] for k, f in names.items() if f in full}
        absent = [f for f in names.values() if f not in full]
        missing = [f for f in absent if not self._saved_elsewhere(f)]
        if missing and strict:
            raise CheckpointError(f"the checkpoint has no weights for {len(missing)} tensors of this pipeline stage "
                                  f"(e.g. {missing[0]}): it was written for another model")
        module.load_state_dict(local, strict=strict and not absent)
        synchronize(self.ties)

    def full_names(self, module: torch.nn.Module) -> dict[str, str]:
        return self.stage.full_names()

    def gather_stages(self, local: dict[str, Tensor]) -> dict[str, Tensor] | None:
        names = self.stage.full_names()
        # Host copies: gather_object pickles tensors with their device, and rank 0 would rebuild another rank's
        # CUDA tensors on that rank's GPU index (or fail where it is not visible).
        mine = {names[k]: v.detach().cpu() if torch.is_tensor(v) else v for k, v in local.items()}
        gathered: list | None = [None] * self.pp_comm.size if self.pp_comm.rank == 0 else None
        dist.gather_object(mine, gathered, dst=self.pp_comm.global_rank(0), group=self.pp_comm.group)
        return {k: v for part in gathered for k, v in part.items()} if gathered is not None else None

    def close(self) -> None:
        self.runtime.close()


def apply_pipeline(model: torch.nn.Module, *, section: PipelineConfig, num_microbatches: int, mesh: ParallelMesh,
                   ledger: CommLedger, device: torch.device) -> PipelineRunner:
    """Cut ``model`` for this rank's stage (`split_model`; the parameters of other stages are released) and
    build its runtime, running ``num_microbatches`` (gradient_accumulation_steps) per step. Collective only for
    weights tied across stages (their groups, created by every rank, and the copies made equal).

    Layout: the mesh's (pp, dp, tp) axes (`topology.MeshShape`). A pipeline is the ranks of one (dp, tp) index
    (group "pp"); the replicas of one stage form its dp group, over which the stage's gradients are synchronised
    by the engine's ordinary gradient sync. With tensor parallelism (3D) the model was sliced before the split:
    each stage's layers hold this rank's TP slices and the TP collectives run inside the stage's forward and
    backward, in the same order on every TP rank of a stage (they all run the same schedule).
    """
    stage = split_model(model, num_stages=section.stages, stage=mesh.rank(Axis.PP),
                        virtual_stages=section.virtual_stages, partition=section.partition)
    release_unowned(model, stage)
    pp_comm = mesh.comm(Axis.PP, ledger, name="pp")
    runtime = PipelineRuntime(stage, pp_comm, schedule=section.schedule, num_microbatches=num_microbatches,
                              device=device)
    return PipelineRunner(stage=stage, runtime=runtime, pp_comm=pp_comm,
                          dp_metrics=mesh.comm(Axis.DP, ledger, name="dp:metrics"),
                          ties=build_ties(stage.tied_weights(), stage.tie_stages, mesh, ledger))
