"""ZeRO stage 3 assembly: shard the model, build the optimizer step and the runtime the engine drives.

Model states per rank (psi parameters, N = dp size, e = model dtype bytes, padding aside):

    params     e * psi / N          unit shards (+ persistent parameters, whole)
    grads      e * psi / N          grad shards
    optimizer  K * psi / N          states of the shard masters (+ fp32 masters under bf16/fp16)

Checkpoints (`checkpoint_per_rank`): rank 0's module states hold empty placeholders for sharded parameters
(as DeepSpeed's ZeRO-3 files do); each rank's optimizer file holds its masters, i.e. its parameter shards.
A full state dict is `engine.grad_sync.gathered_state_dict()` (collective); loading a full state dict into
the module (`model.load_state_dict(full)` on every rank) splits it into the shards.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardwise.checkpoint import CheckpointError
from shardwise.comm.collectives import Comm
from shardwise.errors import UserError
from shardwise.parallel.zero.buckets import ZeroBucket, build_zero_buckets
from shardwise.parallel.zero.grads import ZeroGradReducer
from shardwise.parallel.zero.optimizer import ShardedOptimizer, make_shard_masters
from shardwise.parallel.zero.params import PARTITION_ATTR, FlatKey, FlatShard, Partition, rekey, shard_model
from shardwise.parallel.zero.stage3 import ZeroParamRuntime
from shardwise.precision import LossScaler


class Stage3Optimizer(ShardedOptimizer):
    """`ShardedOptimizer` over unit shards (which stay sharded: no all-gather after the step) and persistent
    buckets (all-gathered after the step, as in ZeRO-2)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, runtime: ZeroParamRuntime, flats: list[FlatShard],
                 persistent: list[ZeroBucket], masters: list[torch.nn.Parameter], separate_masters: bool,
                 comm: Comm, flags_comm: Comm, scaler: LossScaler, clip: float, check_overflow: bool,
                 tp_grads: Any = None):
        super().__init__(optimizer, buckets=[*flats, *persistent], masters=masters,  # type: ignore[list-item]
                         separate_masters=separate_masters, comm=comm, flags_comm=flags_comm, scaler=scaler,
                         clip=clip, check_overflow=check_overflow, gather_after_step=False, tp_grads=tp_grads)
        self.runtime = runtime
        self.flats = flats
        self.persistent = persistent

    def step(self) -> bool:
        applied = super().step()
        if applied:
            self._gather_persistent()
        return applied

    @torch.no_grad()
    def _gather_persistent(self) -> None:
        # A separate send buffer: the input of all_gather must not alias its output.
        handles = [self.comm.all_gather_into_tensor(b.param_flat, b.param_shard.clone(), async_op=True)
                   for b in self.persistent]
        for h in handles:
            h.wait()

    def param_bytes(self) -> int:
        """Unit shards plus persistent parameters (whole), not the transient gathered buffers."""
        shards = sum(f.shard.numel() * f.shard.element_size() for f in self.runtime.partition.flats)
        whole = sum(p.numel() * p.element_size() for p in self.runtime.partition.persistent)
        return shards + whole

    def _layout(self) -> list[int]:
        return [b.layout.numel for b in self.buckets]

    def state_dict(self) -> dict:
        return dict(super().state_dict(), zero_stage=3, flat_numels=self._layout())

    @torch.no_grad()
    def load_state_dict(self, state: dict, *, load_optimizer_states: bool = True) -> None:
        if state.get("zero_stage") != 3 or state.get("flat_numels") != self._layout():
            raise CheckpointError(
                f"this optimizer shard (ZeRO stage {state.get('zero_stage', '1 or 2')}) does not match this ZeRO-3 "
                f"model's layout: load it with the same model, zero_optimization.stage, "
                f"stage3_param_persistence_threshold and param groups it was saved with")
        super().load_state_dict(state, load_optimizer_states=load_optimizer_states)
        self._gather_persistent()

    def sync_masters_from_model(self) -> None:
        if self.runtime.loaded_placeholders:
            raise CheckpointError("load_module_only=True with a ZeRO-3 checkpoint: its module states hold empty "
                                  "placeholders (the weights are in the per-rank optimizer files); load it with "
                                  "load_module_only=False, or load a full state dict into the model")
        super().sync_masters_from_model()


def _refuse_unsupported(cfg: Any) -> None:
    unsupported = {"communication.all_reduce = ring": str(cfg.communication.all_reduce) == "ring",
                   "communication_data_type": cfg.communication.data_type is not None,
                   "prescale_gradients": cfg.prescale_gradients,
                   "gradient_predivide_factor": cfg.gradient_predivide_factor != 1.0}
    given = [k for k, v in unsupported.items() if v]
    if given:
        raise UserError(f"{', '.join(given)}: only supported with zero_optimization.stage 0 for now "
                        f"(ZeRO stage 3 reduce-scatters gradients with the backend); remove it")



def _partition(model: torch.nn.Module, cfg: Any, key_of: Callable[[torch.nn.Parameter], FlatKey], comm: Comm,
               device: torch.device, unit_modules: list[tuple[str, torch.nn.Module]] | None = None) -> Partition:
    zero = cfg.zero
    given: Partition | None = getattr(model, PARTITION_ATTR, None)
    if given is None:
        return shard_model(model, key_of=key_of, dp_size=comm.size, dp_rank=comm.rank,
                           persistence_threshold=zero.stage3_param_persistence_threshold,
                           model_persistence_threshold=zero.stage3_model_persistence_threshold, modules=unit_modules)
    if (given.dp_size, given.dp_rank) != (comm.size, comm.rank):
        raise UserError(f"the model was materialized for data-parallel rank {given.dp_rank} of {given.dp_size}, "
                        f"but this run is rank {comm.rank} of {comm.size}: materialize it with the same group")
    for key, mine in (("stage3_param_persistence_threshold", given.persistence_threshold),
                      ("stage3_model_persistence_threshold", given.model_persistence_threshold)):
        if getattr(zero, key) != mine:
            raise UserError(f"zero_optimization.{key} = {getattr(zero, key)} but the model was materialized with "
                            f"{mine}: pass the same value to materialize_sharded and the config")
    return rekey(given, key_of=key_of, comm=comm, device=device)


def build_stage3(cfg: Any, model: torch.nn.Module, groups: list[dict], *,
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], scaler: LossScaler,
                 dp_comm: Comm, flags_comm: Comm, dtype: torch.dtype, device: torch.device,
                 check_overflow: bool, tp_comm: Comm | None = None,
                 pipeline_stage: torch.nn.Module | None = None) -> tuple[Stage3Optimizer, ZeroParamRuntime]:
    """Shard `model` (a full model, or one built by `materialize_sharded`) and build the engine's
    `optimizer_step` and `grad_sync` for ZeRO stage 3. `tp_comm`: the TP group of a tensor-parallel model
    (already sliced), over which the clipping norm and the overflow verdict are completed.
    `pipeline_stage`: `model` is this rank's pipeline stage (`PipelineStage`), whose model chunks run one at a
    time: each chunk is a root (a whole forward) and each of its layers a unit."""
    _refuse_unsupported(cfg)
    zero = cfg.zero
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}

    def key_of(p: torch.nn.Parameter) -> FlatKey:
        return FlatKey(group_of.get(id(p)), p.dtype)

    unit_modules = roots = None
    if pipeline_stage is not None:
        roots = list(pipeline_stage.chunks)
        unit_modules = [(f"chunks.{v}.layers.{j}", layer) for v, chunk in enumerate(roots)
                        for j, layer in enumerate(chunk.layers)]
    partition = _partition(model, cfg, key_of, dp_comm, device, unit_modules)
    if zero.offloads_params:      # shards wait on the CPU between uses; masters may then view them there
        for f in partition.flats:
            f.offload(torch.device("cpu"), pin_memory=zero.offload_param.pin_memory)
    setattr(model, PARTITION_ATTR, partition)
    kept = {id(p) for p in partition.persistent}
    persistent = build_zero_buckets([[p for p in g["params"] if id(p) in kept] for g in groups],
                                    dp_size=dp_comm.size, dp_rank=dp_comm.rank, bucket_numel=zero.reduce_bucket_size)
    flats = [f for f in partition.flats if f.group is not None]
    offload = zero.offload_optimizer if zero.offloads_optimizer else None
    # offload_param alone keeps the optimizer on the compute device (as DeepSpeed does): the masters then cannot
    # be the parameter shards, which wait on the CPU.
    separate = dtype != torch.float32 or offload is not None or zero.offloads_params
    master_groups, masters = make_shard_masters(
        [*flats, *persistent], groups, separate=separate,  # type: ignore[list-item]
        offload_device=torch.device("cpu") if offload else None, pin_memory=bool(offload and offload.pin_memory))
    optimizer = make_optimizer(master_groups)
    reducer = ZeroGradReducer(persistent, dp_comm, partition_grads=True) if persistent else None
    runtime = ZeroParamRuntime(model, partition, dp_comm, persistent=reducer,
                               prefetch_numel=zero.stage3_prefetch_bucket_size,
                               max_live_numel=zero.stage3_max_live_parameters, roots=roots)
    tp_grads = None
    if tp_comm is not None:
        from shardwise.parallel.tensor_parallel.grads import ShardedTensorParallelGrads
        tp_grads = ShardedTensorParallelGrads(tp_comm, [*flats, *persistent])
    step = Stage3Optimizer(optimizer, runtime=runtime, flats=flats, persistent=persistent, masters=masters,
                           separate_masters=separate, comm=dp_comm, flags_comm=flags_comm, scaler=scaler,
                           clip=cfg.gradient_clipping, check_overflow=check_overflow, tp_grads=tp_grads)
    return step, runtime
