"""`init_distributed` and `initialize`: build the engine's strategy objects once.

`initialize` reads as its order of construction: config -> mesh (the process groups; with context parallelism
the parameters' view folds cp into dp) -> expert parallelism (MoE layers' experts cut over ep groups of dp ranks)
-> device and dtype -> identical start (the full model broadcast from world
rank 0) -> tensor parallelism (slices cut from the whole model) -> context parallelism (the model's attention hook)
-> pipeline (this rank's stage, or the whole model) -> activation recomputation of
this rank's blocks -> the norm reducer -> the data-parallel builder (stage 0, or ZeRO 1-3: an updater and a
data-parallel runtime) -> scheduler -> engine.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, NoReturn

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.comm.sequence import SequenceCheck
from shardwise.comm.watchdog import HangWatchdog, backend_timeout_s
from shardwise.config import AutoValues, load_config_for_world
from shardwise.config.resolved import DType, EngineConfig
from shardwise.comm.device import select_device, uses_cuda
from shardwise.engine.engine import Engine, PipelineEngine
from shardwise.errors import ArgumentError, UserError
from shardwise.parallel.context.interface import BatchPart
from shardwise.parallel.interfaces import DataParallelRuntime, Pipeline, RecordsCollectives, UpdateStrategy
from shardwise.engine.optim import build_optimizer, build_scheduler
from shardwise.parallel.experts import apply_expert_parallel
from shardwise.parallel.grad_norm import GradNormReducer
from shardwise.parallel.recompute import apply_recompute
from shardwise.parallel.replicas import broadcast_replicas
from shardwise.parallel.replicated import build_replicated
from shardwise.parallel.single_stage import SingleStage
from shardwise.parallel.update import UpdateRecipe, param_groups_of
from shardwise.parallel.zero.build import build_zero
from shardwise.parallel.precision import make_loss_scaler
from shardwise.engine.skips import skips_nonfinite_steps
from shardwise.telemetry.monitor import TrainingMonitor
from shardwise.comm.topology import Axis, MeshShape, ParallelMesh
from shardwise.engine.param_access import link_params

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


def init_distributed(dist_backend: str | None = None, *, timeout_s: float | None = None,
                     init_method: str | None = None, rank: int = -1, world_size: int = -1) -> None:
    """Initialise the default process group: NCCL when this rank trains on a GPU (`shardwise.comm.device`), else gloo.

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR in the environment) joins the job; with an explicit rendezvous
    (`init_method` such as "tcp://host:port" or "file://path", with `rank` and `world_size`) joins through that; as a
    plain single process creates a world of one with an in-memory store (no port needed). Idempotent. On a GPU the
    rank's device (LOCAL_RANK mod the GPU count) is made current first and passed as `device_id`, so NCCL binds its
    communicator to that GPU (not GPU 0) and creates it eagerly.
    """
    if dist.is_initialized():
        return
    cuda = uses_cuda()
    backend = dist_backend or ("nccl" if cuda else "gloo")
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if cuda and "nccl" in backend:
        kwargs["device_id"] = select_device()
    if init_method is not None or rank != -1 or world_size != -1:
        # torch fills a missing rank or world size from the environment for env://, and refuses otherwise.
        if rank != -1:
            kwargs["rank"] = rank
        if world_size != -1:
            kwargs["world_size"] = world_size
        dist.init_process_group(backend, init_method=init_method, **kwargs)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


class NoOptimizer(torch.optim.Optimizer):
    """The optimizer of an engine built without one (DeepSpeed allows that: Hugging Face's ZeRO-3 evaluation and
    inference call `initialize(model=, config=)` with no optimizer). Forward, backward and evaluation work; an
    update is refused in one line rather than silently doing nothing."""

    def __init__(self, groups: list[dict[str, Any]]):
        super().__init__(groups, {})

    def step(self, closure: Any = None) -> Any:
        raise UserError('engine.step(): this engine was initialized without an optimizer; add an "optimizer" block '
                        'to the config (e.g. {"type": "AdamW", "params": {"lr": 1e-3}}) or pass optimizer= to '
                        'initialize')


def _make_optimizer(optimizer: Any, config: Any, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if optimizer is None:
        if config.optimizer is None:
            return NoOptimizer(groups)
        return build_optimizer(config.optimizer, groups)
    if isinstance(optimizer, torch.optim.Optimizer):
        if config.optimizer is not None:
            raise UserError('both an optimizer object and a config "optimizer" block were given: remove one')
        # The client optimizer was built over the model's parameters; point each of its groups at what we
        # step (fp32 masters under mixed precision, shard masters under ZeRO, else the same tensors).
        if len(optimizer.param_groups) != len(groups):
            raise UserError(f"the optimizer has {len(optimizer.param_groups)} param groups but model_parameters "
                            f"gives {len(groups)} with trainable parameters: build the optimizer over the same "
                            f"parameters you pass as model_parameters")
        for mine, theirs in zip(groups, optimizer.param_groups):
            theirs["params"] = list(mine["params"])
        return optimizer
    if callable(optimizer):
        built: torch.optim.Optimizer = optimizer(groups)       # DeepSpeed's contract for a callable
        return built
    raise UserError(f"optimizer= must be a torch.optim.Optimizer or a callable(params), got {type(optimizer)}")


def initialize(model: torch.nn.Module, model_parameters: Iterable[Any] | None = None,
               config: str | os.PathLike[str] | dict[str, Any] | None = None, training_data: Any = None,
               optimizer: Any = None, lr_scheduler: Any = None,
               collate_fn: Callable[..., Any] | None = None, dist_init_required: bool | None = None,
               args: Any = None, config_params: dict[str, Any] | None = None, *, auto: AutoValues | None = None
               ) -> tuple[Engine, torch.optim.Optimizer | None, DataLoader[Any] | None, Any]:
    """DeepSpeed's `initialize`: returns (engine, optimizer, dataloader or None, lr_scheduler or None).

    Hugging Face "auto" values in the config are filled from `auto` and, where it leaves them None, from
    what is found here: the model's hidden size and a `training_data` DataLoader's batch size."""
    if not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"initialize: model= must be a torch.nn.Module, got {type(model).__name__}; pass the "
                            f"model to train")
    if dist_init_required is False and not dist.is_initialized():
        raise UserError("initialize(dist_init_required=False) but torch.distributed is not initialized: pass "
                        "dist_init_required=True (or leave it None), or call torch.distributed.init_process_group "
                        "first")
    config = _config_source(model, config, config_params, args)
    timeout_s = _timeout_minutes(config) * 60.0
    init_distributed(timeout_s=backend_timeout_s(timeout_s))
    # A group made before (by the caller, or torchrun scripts' own init) gets the configured timeout too.
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=backend_timeout_s(timeout_s)))
    if hasattr(args, "local_rank"):      # DeepSpeed aligns a script's --local_rank with the launcher's
        args.local_rank = int(os.environ.get("LOCAL_RANK", 0))
    ledger = CommLedger()
    world = dist.get_world_size()
    known = (auto or AutoValues()).merged(AutoValues(hidden_size=hidden_size_of(model),
                                                     micro_batch=_loader_batch_size(training_data)))
    cfg = load_config_for_world(config, world_size=world, auto=known)  # batch rule, dp = world / (tp * pp * cp)
    _check_context_parallel(model, cfg)      # a model that cannot split its sequences: one line, before any work
    layout = ParallelMesh.build(MeshShape.for_world(world, tp=cfg.tensor_parallel.size, pp=cfg.pipeline.stages,
                                                    cp=cfg.context_parallel.size),
                                timeout_s=backend_timeout_s(timeout_s))
    # Every cp rank holds the same parameters as its dp peers: what follows (gradients, ZeRO, norms, checkpoints,
    # the engine) sees dp x cp as its data-parallel group; only the data and the attention see cp itself.
    mesh = layout.cp_folded()
    watchdog = HangWatchdog.attach(ledger, rank=dist.get_rank(), world=world, timeout_s=timeout_s)
    check = SequenceCheck.build(ledger, mesh.guard_comm(ledger, name="world:check"), stage=mesh.rank(Axis.PP),
                                stages=mesh.size(Axis.PP), wait_s=min(timeout_s, 60.0),
                                enabled=cfg.communication.desync_check)
    # Experts split over ep ranks of each dp group, cut from the whole model before the identical start (which
    # then takes each expert from its expert-dp group's first rank).
    apply_expert_parallel(model, cfg.expert_parallel.size, mesh.shape.groups(Axis.DP), ledger)
    device, dtype = select_device(), cfg.precision.dtype.torch_dtype
    _start_identical(model, device, dtype, ledger)
    for module in model.modules():     # layers that communicate themselves (MoE all-to-alls) record here too
        if isinstance(module, RecordsCollectives):
            module.record_into(ledger)
    model_parameters = _tensor_parallel(model, model_parameters, cfg, mesh, ledger)
    batch_part = _context_parallel(model, cfg, layout, ledger)
    original_model = model
    model, pipeline, stage_names = _pipeline(model, cfg, mesh, ledger, device)
    _recompute(model, pipeline, cfg, mesh, ledger)
    groups = param_groups_of(pipeline.owned(model_parameters) if model_parameters is not None
                             else model.parameters())
    recipe = UpdateRecipe(make_optimizer=lambda g: _make_optimizer(optimizer, cfg, g),
                          scaler=make_loss_scaler(cfg.precision), clip=cfg.gradient_clipping,
                          check_overflow=skips_nonfinite_steps(cfg), dtype=dtype,
                          compute_norm=cfg.zero.compute_grad_norm)
    norms = GradNormReducer.from_mesh(mesh, ledger)
    dp_comm = mesh.comm(Axis.DP, ledger, name="dp")
    updater: UpdateStrategy
    dp_runtime: DataParallelRuntime
    if cfg.zero.stage == 0:
        updater, dp_runtime = build_replicated(groups, section=cfg.data_parallel, recipe=recipe, dp_comm=dp_comm,
                                               norms=norms, tied=pipeline.tied_params())
    else:
        updater, dp_runtime = build_zero(model, groups, section=cfg.zero, recipe=recipe, dp_comm=dp_comm,
                                         norms=norms, device=device, units=pipeline.sharding_units(),
                                         tied=pipeline.tied_params())
    link_params(updater)
    sched = _scheduler(lr_scheduler, cfg, updater.optimizer)
    stages = cfg.pipeline.stages
    monitor = TrainingMonitor(cfg.monitors, module=model, ledger=ledger, device=device, global_rank=dist.get_rank(),
                              world_size=world, dp_size=dp_comm.size, mp_size=world // dp_comm.size,
                              micro_batch=cfg.batch.micro_batch, scales_loss=cfg.precision.dtype is DType.FP16,
                              # under a pipeline each stage's first rank profiles its own modules
                              profiles=(mesh.rank(Axis.DP), mesh.rank(Axis.TP)) == (0, 0) if stages > 1 else None,
                              pipeline_stage=(mesh.rank(Axis.PP), stages) if stages > 1 else None,
                              module_names=stage_names)
    from shardwise.parallel.pipeline.module import PipelineModule
    # DeepSpeed's rule: a PipelineModule gets a PipelineEngine, whatever its stage count.
    engine_class = PipelineEngine if stages > 1 or isinstance(original_model, PipelineModule) else Engine
    engine = engine_class(module=model, config=cfg, mesh=mesh, update=updater, dp_runtime=dp_runtime,
                          pipeline=pipeline, lr_scheduler=sched, ledger=ledger, device=device, compute_dtype=dtype,
                          monitor=monitor, sequence_check=check, watchdog=watchdog, batch_part=batch_part,
                          data_mesh=layout)
    loader: DataLoader[Any] | None = None
    if training_data is not None:
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler
        if isinstance(training_data, DataLoader):   # its batch size filled "auto"; we shard its dataset
            collate_fn = collate_fn or training_data.collate_fn
            training_data = training_data.dataset
        # dp ranks read different samples; the cp ranks of one dp rank read the same (each takes its tokens).
        sampler: DistributedSampler[Any] = DistributedSampler(training_data, num_replicas=layout.size(Axis.DP),
                                                              rank=layout.rank(Axis.DP),
                                                              shuffle=not pipeline.reads_in_order)
        loader = DataLoader(training_data, batch_size=cfg.batch.micro_batch, sampler=sampler,
                            collate_fn=collate_fn, drop_last=True)
        engine.training_dataloader = loader
    # DeepSpeed returns no optimizer when it was given none.
    returned = None if isinstance(engine.optimizer, NoOptimizer) else engine.optimizer
    return engine, returned, loader, sched


def _config_source(model: torch.nn.Module, config: Any, config_params: dict[str, Any] | None, args: Any) -> Any:
    """DeepSpeed's places for the config: config=, config_params=, args.deepspeed_config (or the deprecated
    args.deepscale_config); a PipelineModule's stages and partition become its pipeline block."""
    from_args = getattr(args, "deepspeed_config", None)
    legacy = getattr(args, "deepscale_config", None)
    if legacy is not None:
        if from_args is not None:
            raise UserError("both --deepspeed_config and --deepscale_config were given: keep --deepspeed_config")
        from_args = legacy
    if config is None:
        config = config_params
    if config is not None and from_args is not None:
        raise UserError("a config was given both to shardwise.initialize (config=) and in args.deepspeed_config "
                        "(--deepspeed_config): give only one")
    if config is None:
        config = from_args
    if config is None:
        raise UserError("shardwise.initialize needs config= (a DeepSpeed JSON path or dict) or "
                        "args.deepspeed_config (--deepspeed_config, see shardwise.add_config_arguments)")
    from shardwise.parallel.pipeline.module import PipelineModule
    if isinstance(model, PipelineModule) and model.num_stages is not None:
        from shardwise.config.load import read_config
        config = model.pipeline_block(read_config(config))
    return config


def _timeout_minutes(config: Any) -> float:
    """communication.timeout_minutes, read before the process group exists (the config is validated after: the
    batch rule needs the world size); the default when absent or not a positive number (then refused later)."""
    from shardwise.config.load import read_config
    from shardwise.config.resolved import CommConfig
    value = (read_config(config).get("communication") or {}).get("timeout_minutes")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e7:
        return float(value)
    return CommConfig().timeout_minutes


def hidden_size_of(model: torch.nn.Module) -> int | None:
    """The model's hidden size, where Hugging Face's integration looks for it (`config.hidden_size`, the largest
    of `config.hidden_sizes`, the same under `config.text_config`) or our GPT's `cfg.d_model`; None if absent."""
    for holder in (getattr(model, "config", None), getattr(getattr(model, "config", None), "text_config", None)):
        if holder is None:
            continue
        size = getattr(holder, "hidden_size", None)
        if isinstance(size, int):
            return size
        sizes = getattr(holder, "hidden_sizes", None)
        if sizes:
            return int(max(sizes))
    d_model = getattr(getattr(model, "cfg", None), "d_model", None)
    return d_model if isinstance(d_model, int) else None


def _loader_batch_size(training_data: Any) -> int | None:
    """The batch size of a DataLoader passed as training_data (a plain dataset has none)."""
    size = getattr(training_data, "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _start_identical(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, ledger: CommLedger) -> None:
    """The model on its device in the training dtype (as DeepSpeed casts it), and the FULL model from world rank 0
    on every rank, before any tensor-parallel slicing: all TP ranks must cut their slices from one model (a
    dp-group broadcast would leave TP peers on different models). A parameter held by a subgroup only (an expert
    under expert parallelism) comes from that group's first rank instead."""
    model.to(device)
    if dtype != torch.float32:
        model.to(dtype)
    broadcast_replicas([*model.parameters(), *model.buffers()], Comm(None, ledger, name="dp:init"))


def _tensor_parallel(model: torch.nn.Module, model_parameters: Iterable[Any] | None, cfg: EngineConfig,
                     mesh: ParallelMesh, ledger: CommLedger) -> Iterable[Any] | None:
    """Slice the whole model in place (its plan names the full model's modules; under 3D every pipeline stage
    then holds its layers' slices); `model_parameters`, given from the full model, then name the slices."""
    if cfg.tensor_parallel.size == 1:
        return model_parameters
    from shardwise.models.parallelize import parallelize_model
    info = parallelize_model(model, mesh.comm(Axis.TP, ledger), sequence_parallel=cfg.tensor_parallel.sequence_parallel)
    return info.remap(model_parameters) if model_parameters is not None else None


def _check_context_parallel(model: torch.nn.Module, cfg: EngineConfig) -> None:
    if cfg.context_parallel.size > 1:
        from shardwise.models.context_parallel import check_model_for_context_parallel
        check_model_for_context_parallel(model, cfg.context_parallel, tp=cfg.tensor_parallel.size)


def _context_parallel(model: torch.nn.Module, cfg: EngineConfig, layout: ParallelMesh,
                      ledger: CommLedger) -> BatchPart | None:
    """Context parallelism: the model's attention, positions and loss over this rank's part of each sequence (its
    hook, beside the model), and how the step driver takes that part of a micro-batch; None without cp."""
    from shardwise.parallel.context import build_context_parallel
    cp = build_context_parallel(cfg.context_parallel, layout.comm(Axis.CP, ledger))
    if cp is None:
        return None
    from shardwise.models.context_parallel import apply_context_parallel
    return apply_context_parallel(model, cp)


def _pipeline(model: torch.nn.Module, cfg: EngineConfig, mesh: ParallelMesh, ledger: CommLedger,
              device: torch.device) -> tuple[torch.nn.Module, Pipeline, dict[str, str] | None]:
    """This rank's module and how a global batch runs on it: under a pipeline the rank's stage (every strategy
    built after this sees only the stage's parameters), else the whole model. Third: under a pipeline, the
    stage's layer names in the full model (what the monitor's profiler reports them as)."""
    if cfg.pipeline.stages == 1:
        return model, SingleStage(mesh.comm(Axis.DP, ledger, name="dp:metrics")), None
    from shardwise.parallel.pipeline.apply import apply_pipeline
    runner = apply_pipeline(model, section=cfg.pipeline, num_microbatches=cfg.batch.grad_accum, mesh=mesh,
                            ledger=ledger, device=device)
    return runner.stage, runner, runner.stage.module_names()


def _recompute(model: torch.nn.Module, pipeline: Pipeline, cfg: EngineConfig, mesh: ParallelMesh,
               ledger: CommLedger) -> None:
    """Activation recomputation of this rank's blocks (its stage's), before ZeRO shards them. Partitioned
    checkpoints spread over the TP group, where block inputs are replicated: not with sequence parallelism,
    whose block inputs are already sequence shards [s/t, b, h] (the key then has nothing to split)."""
    section = cfg.activation_checkpointing
    group = None
    if not cfg.tensor_parallel.sequence_parallel:     # (a TP group of size 1 partitions nothing)
        group = mesh.comm(Axis.TP, ledger, name="tp:recompute")
    if section.contiguous_memory_optimization:
        warnings.warn("activation_checkpointing.contiguous_memory_optimization has no effect in shardwise (torch's "
                      "caching allocator reuses the equal-sized partitions); it is accepted", stacklevel=3)
    from shardwise.parallel.recompute_api import profile_sink
    from shardwise.models.parallelize import HuggingFaceAttention
    apply_recompute(pipeline.blocks(model), section, partition_group=group, times=profile_sink(),
                    attention_functions=HuggingFaceAttention())


def _scheduler(lr_scheduler: Any, cfg: EngineConfig, optimizer: torch.optim.Optimizer) -> Any:
    """The client's scheduler (an object, or a callable of the optimizer), else the config's block, else None."""
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    if lr_scheduler is None and cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler, optimizer)
    return lr_scheduler


def exit_rank(code: int) -> NoReturn:
    """End a launched rank without interpreter finalization.

    After destroy_process_group, gloo's worker threads may still hold AsyncWork objects with tensors;
    destroying those while the interpreter finalizes aborts the process (SIGABRT, "terminate called without
    an active exception"), which turns a finished run into a failed one under torchrun. Output is flushed
    first; everything else the process owns is released by the OS."""
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if TYPE_CHECKING:
    from shardwise.checkpoint.context import Progress
    from shardwise.engine.step import TrainingSteps
    from shardwise.parallel.data_parallel import BucketedAllReduce
    from shardwise.parallel.experts import MoELayer
    from shardwise.parallel.interfaces import StepDriver
    from shardwise.parallel.pipeline.apply import PipelineRunner
    from shardwise.parallel.replicated import ReplicatedUpdate
    from shardwise.parallel.zero.grads import ZeroGradReducer
    from shardwise.parallel.zero.optimizer import ShardedUpdate, Stage3Update
    from shardwise.parallel.zero.stage3 import ZeroParamRuntime
    from shardwise.telemetry.monitor import StepProgress

    def _implements_protocols(replicated: ReplicatedUpdate, sharded: ShardedUpdate, stage3: Stage3Update,
                              all_reduce: BucketedAllReduce, zero_grads: ZeroGradReducer,
                              zero_params: ZeroParamRuntime, single: SingleStage, runner: PipelineRunner,
                              steps: TrainingSteps, moe: MoELayer) -> None:
        """Never called. The strategies implement the Protocols of `parallel/interfaces.py` structurally and the
        builders return concrete classes, so here the type checker verifies every implementation against every
        Protocol it is handed out as (a missing member or a changed signature fails CI)."""
        updates: list[UpdateStrategy] = [replicated, sharded, stage3]
        runtimes: list[DataParallelRuntime] = [all_reduce, zero_grads, zero_params]
        pipelines: list[Pipeline] = [single, runner]
        driver: StepDriver = steps
        progress: StepProgress = steps
        saved: Progress = steps
        communicating: RecordsCollectives = moe
