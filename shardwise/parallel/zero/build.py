"""ZeRO stages 1-3 assembled (`build_zero`): buckets or unit shards, shard masters, the update and the runtime the
engine drives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shardwise.comm.collectives import Comm
from shardwise.config import ZeroConfig
from shardwise.errors import UserError
from shardwise.parallel.grad_norm import GradNormReducer, shard_layout
from shardwise.parallel.replicas import ReplicaComms, replicas_of, split_by_replicas
from shardwise.parallel.tied import TiedParams, uncounted
from shardwise.parallel.update import UpdateRecipe
from shardwise.parallel.zero.buckets import ZeroBucket, build_zero_buckets
from shardwise.parallel.zero.grads import ZeroGradReducer
from shardwise.parallel.zero.gathered import record_locations
from shardwise.parallel.zero.optimizer import ShardedUpdate, Stage3Update, make_shard_masters
from shardwise.parallel.zero.flat import FlatKey
from shardwise.parallel.zero.params import PARTITION_ATTR, Partition, plan_units, rekey, shard_model
from shardwise.parallel.zero.stage3 import ZeroParamRuntime


@dataclass(frozen=True)
class ShardingUnits:
    """How ZeRO-3 cuts a module that is not one whole forward: `roots` run one at a time (a pipeline stage's
    model chunks), `units` (name, module) are gathered and freed one by one. Default (None): the module is
    the only root and the children of its largest ModuleList are the units."""

    roots: list[torch.nn.Module]
    units: list[tuple[str, torch.nn.Module]]


def build_zero(model: torch.nn.Module, groups: list[dict], *, section: ZeroConfig, recipe: UpdateRecipe,
               dp_comm: Comm, norms: GradNormReducer, device: torch.device, units: ShardingUnits | None = None,
               tied: TiedParams = TiedParams()) -> tuple[ShardedUpdate, ZeroGradReducer | ZeroParamRuntime]:
    """The update and the runtime of ZeRO stage `section.stage` (1-3) over `groups`, this rank's trainable
    parameters of `model`, sharded over `dp_comm`. Each `tied` copy (a weight several pipeline stages hold) gets a
    bucket of its own: its shard is then the same elements on every stage holding it (same size, same dp split),
    summed over those stages like a whole tensor.

    Model states per rank (psi parameters, N = dp size, e = model dtype bytes, K = optimizer bytes per parameter,
    padding aside):

        stage   params        grads         optimizer
        1       e * psi       e * psi       K * psi / N     gradients reduce-scattered on the boundary
        2       e * psi       e * psi / N   K * psi / N     reduce-scattered on every micro-batch
        3       e * psi / N   e * psi / N   K * psi / N     parameters gathered per unit around its use

    Under bf16/fp16 or offload the masters are separate fp32 shards (inside K). Checkpoints are per rank: the
    optimizer file of each rank holds its masters. Under ZeRO-3 rank 0's module states hold empty placeholders
    for sharded parameters (as DeepSpeed's files do); a full state dict is `runtime.gathered_state_dict(module)`
    (collective), and loading a full state dict into the module splits it into the shards."""
    if section.stage == 3:
        if tied:
            raise UserError("zero_optimization.stage = 3 with weights tied across pipeline stages (TiedLayerSpec) "
                            "is not supported: use stage 1 or 2 (as DeepSpeed's pipeline does)")
        return _stage3(model, groups, section=section, recipe=recipe, dp_comm=dp_comm, norms=norms, device=device,
                       units=units)
    buckets = _replica_buckets(groups, dp_comm, section.reduce_bucket_size, tied.ids())
    slots = tuple(tied.slots({id(b.params[0]): k for k, b in enumerate(buckets) if len(b.params) == 1}))
    separate = recipe.dtype != torch.float32 or section.offloads_optimizer
    optimizer, masters, bound = _shard_optimizer(buckets, groups, section, recipe, norms, separate=separate,
                                                 uncounted=uncounted(slots))
    update = ShardedUpdate(optimizer, buckets=buckets, masters=masters, separate_masters=separate, comm=dp_comm,
                           recipe=recipe, norms=bound, tied=slots)
    # DeepSpeed checks for parameters without a gradient where it offloads the optimizer (its step's norm)
    require_all_used = section.offloads_optimizer and not section.ignore_unused_parameters
    return update, ZeroGradReducer(buckets, dp_comm, partition_grads=section.stage >= 2,
                                   require_all_used=require_all_used)


def _replica_buckets(groups: list[dict], dp_comm: Comm, bucket_numel: int, alone: set[int]) -> list[ZeroBucket]:
    """Buckets of each replica group's parameters (`parallel/replicas.py`), each sharded over its own group: the
    dp group's first, then each subgroup's (experts over their expert-dp group)."""
    comms = ReplicaComms(dp_comm.ledger)
    buckets: list[ZeroBucket] = []
    for replicas, part in split_by_replicas([p for g in groups for p in g["params"]]):
        ids = {id(p) for p in part}
        comm = comms.of(replicas)
        over = comm if comm is not None else dp_comm
        buckets += build_zero_buckets([[p for p in g["params"] if id(p) in ids] for g in groups], dp_size=over.size,
                                      dp_rank=over.rank, bucket_numel=bucket_numel, alone=alone, comm=comm,
                                      first_index=len(buckets))
    return buckets


def _shard_optimizer(buckets: list, groups: list[dict], section: ZeroConfig, recipe: UpdateRecipe,
                     norms: GradNormReducer, *, separate: bool, uncounted: frozenset[int] = frozenset()
                     ) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter], GradNormReducer]:
    """Shard masters (on the CPU under offload_optimizer), the user's optimizer over them, and the norm
    reducer bound to their layout: dp ranks hold disjoint shards, so the norm sums over them as over the parts of
    one model."""
    offload = section.offload_optimizer if section.offloads_optimizer else None
    master_groups, masters = make_shard_masters(
        buckets, groups, separate=separate, offload_device=torch.device("cpu") if offload else None,
        pin_memory=bool(offload and offload.pin_memory))
    bound = norms.for_tensors(shard_layout(buckets), dp_sharded=True, uncounted=uncounted)
    return recipe.make_optimizer(master_groups), masters, bound


def _stage3(model: torch.nn.Module, groups: list[dict], *, section: ZeroConfig, recipe: UpdateRecipe,
            dp_comm: Comm, norms: GradNormReducer, device: torch.device,
            units: ShardingUnits | None) -> tuple[Stage3Update, ZeroParamRuntime]:
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}

    def key_of(p: torch.nn.Parameter) -> FlatKey:
        return FlatKey(group_of.get(id(p)), p.dtype, replicas_of(p))

    partition = _partition(model, section, key_of, dp_comm, device, units.units if units is not None else None)
    offload_param = section.offload_param if section.offloads_params else None
    if offload_param is not None:          # shards wait on the CPU between uses; masters may then view them there
        for f in partition.flats:
            f.offload(torch.device("cpu"), pin_memory=offload_param.pin_memory)
    setattr(model, PARTITION_ATTR, partition)
    kept = {id(p) for p in partition.persistent}
    persistent = _replica_buckets([dict(g, params=[p for p in g["params"] if id(p) in kept]) for g in groups],
                                  dp_comm, section.reduce_bucket_size, set())
    flats = [f for f in partition.flats if f.group is not None]
    reducer = ZeroGradReducer(persistent, dp_comm, partition_grads=True) if persistent else None
    runtime = ZeroParamRuntime(model, partition, dp_comm, persistent=reducer,
                               prefetch_numel=section.stage3_prefetch_bucket_size,
                               max_live_numel=section.stage3_max_live_parameters,
                               roots=units.roots if units is not None else None)
    record_locations(partition, runtime, dp_comm)
    # offload_param alone keeps the optimizer on the compute device (as DeepSpeed does): the masters then cannot
    # be the parameter shards, which wait on the CPU.
    separate = recipe.dtype != torch.float32 or section.offloads_optimizer or section.offloads_params
    optimizer, masters, bound = _shard_optimizer([*flats, *persistent], groups, section, recipe, norms,
                                                 separate=separate)
    update = Stage3Update(optimizer, runtime=runtime, flats=flats, persistent=persistent, masters=masters,
                          separate_masters=separate, comm=dp_comm, recipe=recipe, norms=bound)
    return update, runtime


def _partition(model: torch.nn.Module, section: ZeroConfig, key_of: Callable[[torch.nn.Parameter], FlatKey],
               comm: Comm, device: torch.device, unit_modules: list[tuple[str, torch.nn.Module]] | None) -> Partition:
    """The model's unit shards: cut here, or re-keyed from the `Partition` that `materialize_sharded` built
    (the full model never existed on this rank), after checking it was built for this group and thresholds."""
    given: Partition | None = getattr(model, PARTITION_ATTR, None)
    if given is None:
        return shard_model(model, key_of=key_of, dp_size=comm.size, dp_rank=comm.rank,
                           persistence_threshold=section.stage3_param_persistence_threshold,
                           model_persistence_threshold=section.stage3_model_persistence_threshold,
                           modules=unit_modules, comms=ReplicaComms(comm.ledger))
    if any(key_of(p).replicas is not None for p in model.parameters()):
        raise UserError("a model materialized sharded (materialize_sharded / zero.Init) with expert-parallel "
                        "parameters is not supported: build it whole, then shard_experts, then initialize")
    if (given.dp_size, given.dp_rank) != (comm.size, comm.rank):
        raise UserError(f"the model was materialized for data-parallel rank {given.dp_rank} of {given.dp_size}, "
                        f"but this run is rank {comm.rank} of {comm.size}: materialize it with the same group")
    if given.persistence_deferred:
        # zero.Init sharded every parameter (DeepSpeed's zero.Init does too); the config's thresholds pick the
        # persistent ones now, by the rule shard_model applies to a whole model
        thresholds = (section.stage3_param_persistence_threshold, section.stage3_model_persistence_threshold)
        shapes = {id(p): s for f in given.flats for p, s in zip(f.params, f.shapes)}
        _, persistent = plan_units(model, persistence_threshold=thresholds[0],
                                   model_persistence_threshold=thresholds[1], modules=[],
                                   shape_of=lambda p: shapes.get(id(p), p.shape))
        return rekey(given, key_of=key_of, comm=comm, device=device, thresholds=thresholds,
                     persistent=[p for p in persistent if id(p) in shapes])
    for key, mine in (("stage3_param_persistence_threshold", given.persistence_threshold),
                      ("stage3_model_persistence_threshold", given.model_persistence_threshold)):
        if getattr(section, key) != mine:
            raise UserError(f"zero_optimization.{key} = {getattr(section, key)} but the model was materialized with "
                            f"{mine}: pass the same value to materialize_sharded and the config")
    return rekey(given, key_of=key_of, comm=comm, device=device)
