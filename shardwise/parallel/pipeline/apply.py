"""Pipeline parallelism inside the engine: split the model for this rank, run `engine.train_batch` through
the schedule, and agree on the whole model's gradient norm and overflow verdict across stages.

Layout: the mesh's (pp, dp, tp) axes (`topology.MeshShape`). A pipeline is the ranks of one (dp, tp) index
(group "pp"); the replicas of one stage form its dp group, over which the stage's gradients are synchronised
by the engine's ordinary gradient sync. With tensor parallelism (3D) the model was sliced before the split:
each stage's layers hold this rank's TP slices and the TP collectives run inside the stage's forward and
backward, in the same order on every TP rank of a stage (they all run the same schedule).

Per global batch (`PipelineTrainer.train_batch`): the first and last stages read M =
gradient_accumulation_steps micro-batches ``(inputs, labels)`` from ``data_iter`` (the middle stages read
nothing, as in DeepSpeed); the runtime runs the schedule (the last stage's loss / M starts each backward,
times the fp16 loss scale); gradients are synchronised over dp during the stage's last backward; the
optimizer steps this stage's parameters. The step's loss (mean over micro-batches) is broadcast from the
last stage and averaged over the dp replicas, so every rank returns the same number. `eval_batch` is the
same pass forward only (any M, any shapes), with no gradient, no synchronisation and no step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.errors import UserError
from shardwise.parallel.pipeline.runtime import PipelineRuntime, StepResult
from shardwise.parallel.pipeline.stage import PipelineStage, release_unowned, split_model
from shardwise.topology import Axis, ParallelMesh


class PipelineGrads:
    """Norm and overflow agreement across the stages: each stage holds a disjoint part of the model, so
    ||g||^2 is the sum over the pipeline group of the stages' ||g||^2 and every stage skips a step when any
    of them overflowed. Same interface as `TensorParallelGrads` (what `ReplicatedOptimizer` calls)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def global_norm(self, params: list[Tensor]) -> float:
        grads = [p.grad.detach() for p in params if p.grad is not None]
        sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else None)
        for g in grads:
            sq += g.double().pow(2).sum()
        self.comm.all_reduce(sq)       # 8 bytes per step over the pipeline group
        return math.sqrt(float(sq))

    def clip_(self, params: list[Tensor], max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s rule (scale by max_norm / (norm + 1e-6) when below 1) with the
        whole model's norm; returns the norm."""
        norm = self.global_norm(params)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
        return norm

    def any_overflow(self, local: bool) -> bool:
        return self.comm.all_reduce_object_max(float(local)) > 0


@dataclass
class PipelineTrainer:
    """This rank's stage, its runtime and its groups; `train_batch` is the engine's step."""

    stage: PipelineStage
    runtime: PipelineRuntime
    pp_comm: Comm
    """This rank's pipeline (group rank = stage)."""
    dp_metrics: Comm
    """The stage's dp group, for the loss average."""
    flags_comm: Comm
    """Every rank holding a part of one model's optimizer state (pp x dp): ZeRO's overflow flag and norm."""
    grads: PipelineGrads
    last: StepResult | None = None
    """The last step's result: its loss, peak in-flight micro-batches and per-action trace (for timelines)."""

    def owned(self, model_parameters: Iterable[Any]) -> list[Any]:
        """``model_parameters`` (tensors or param-group dicts, from the full model) restricted to this stage's."""
        mine = {id(p) for p in self.stage.parameters()}
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            return [dict(g, params=[p for p in g["params"] if id(p) in mine]) for g in items]
        return [p for p in items if id(p) in mine]

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

    def train_batch(self, engine: Any, data_iter: Iterator[Any] | None) -> float:
        """One global batch through the pipeline and one optimizer step; the mean loss on every rank."""
        num_micro = self.runtime.num_microbatches
        micro = self._read(data_iter, num_micro, "engine.train_batch")
        engine.ledger.begin_step(engine.global_steps)
        engine.module.train()
        result = self.runtime.step(micro, loss_scale=engine.optimizer_step.scaler.loss_scale,
                                   grad_sync=engine.grad_sync)
        self.last = result
        loss = self._agreed_mean(result.losses, engine.device)
        # The M micro-steps happened inside the runtime; engine.step() of the last one is the boundary.
        engine.micro_steps += num_micro - 1
        engine.step()
        engine._last_activation_bytes = result.peak_activation_bytes
        return loss

    def eval_batch(self, engine: Any, data_iter: Iterator[Any] | None, num_micro: int) -> float:
        """``num_micro`` micro-batches forward only (`PipelineRuntime.evaluate`; the engine has put the module in
        eval mode); the mean loss on every rank, agreed like `train_batch`'s."""
        micro = self._read(data_iter, num_micro, "engine.eval_batch")
        return self._agreed_mean(self.runtime.evaluate(micro, num_microbatches=num_micro), engine.device)

    def _agreed_mean(self, losses: list[float], device: torch.device) -> float:
        """The mean of the last stage's micro-batch losses (``losses`` is empty elsewhere), broadcast along the
        pipeline and averaged over the dp replicas: the same number on every rank."""
        loss = torch.tensor([sum(losses) / len(losses) if losses else 0.0], dtype=torch.float32, device=device)
        self.pp_comm.broadcast(loss, src_group_rank=self.stage.num_stages - 1)
        self.dp_metrics.all_reduce(loss)
        return float(loss) / self.dp_metrics.size


def apply_pipeline(model: torch.nn.Module, *, config: Any, mesh: ParallelMesh, ledger: CommLedger,
                   device: torch.device) -> PipelineTrainer:
    """Cut ``model`` for this rank's stage (`split_model`; the parameters of other stages are released) and
    build its runtime. Collective-free except for the groups the mesh already holds."""
    pipe = config.pipeline
    stage = split_model(model, num_stages=pipe.stages, stage=mesh.rank(Axis.PP), virtual_stages=pipe.virtual_stages,
                        partition=pipe.partition)
    release_unowned(model, stage)
    pp_comm = mesh.comm(Axis.PP, ledger, name="pp")
    runtime = PipelineRuntime(stage, pp_comm, schedule=pipe.schedule, num_microbatches=config.batch.grad_accum,
                              device=device)
    flags = mesh.comm_sharing_tp(ledger, name="pp*dp:metrics")   # the whole world when tp = 1
    return PipelineTrainer(stage=stage, runtime=runtime, pp_comm=pp_comm,
                           dp_metrics=mesh.comm(Axis.DP, ledger, name="dp:metrics"), flags_comm=flags,
                           grads=PipelineGrads(mesh.comm(Axis.PP, ledger, name="pp:metrics")))
