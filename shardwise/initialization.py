"""`init_distributed` and `initialize`: build the engine's strategy objects once.

`initialize` reads as its order of construction (DESIGN principle 4): config -> mesh (the process groups) ->
device and dtype -> identical start (the full model broadcast from world rank 0) -> tensor parallelism (slices
cut from the whole model) -> pipeline (this rank's stage, or the whole model) -> the norm reducer -> the
data-parallel builder (stage 0, or ZeRO 1-3: an updater and a data-parallel runtime) -> scheduler -> engine.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, NoReturn

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.config import load_config_for_world
from shardwise.config.resolved import DType, EngineConfig
from shardwise.engine import Engine
from shardwise.errors import UserError
from shardwise.interfaces import DataParallelRuntime, Pipeline, Updater
from shardwise.optim import build_optimizer, build_scheduler
from shardwise.parallel.grad_norm import GradNormReducer
from shardwise.parallel.replicated import build_replicated
from shardwise.parallel.single_stage import SingleStage
from shardwise.parallel.update import UpdateRecipe, param_groups_of
from shardwise.parallel.zero.build import build_zero
from shardwise.precision import make_loss_scaler
from shardwise.telemetry.monitor import TrainingMonitor
from shardwise.topology import Axis, MeshShape, ParallelMesh


def init_distributed(dist_backend: str | None = None, *, timeout_s: float | None = None) -> None:
    """Initialise the default process group: NCCL when CUDA is available, else gloo.

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR in the environment) joins the job; as a plain single
    process creates a world of one with an in-memory store (no port needed). Idempotent.
    """
    if dist.is_initialized():
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        import datetime
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def _device_for(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, comm: Comm) -> None:
    """Make every rank start from dp rank 0's parameters and buffers (one flat broadcast per dtype)."""
    if comm.size == 1:
        return
    tensors = [t for t in list(module.parameters()) + list(module.buffers())]
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        comm.broadcast(flat, src_group_rank=0)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _make_optimizer(optimizer: Any, config: Any, groups: list[dict]) -> torch.optim.Optimizer:
    if optimizer is None:
        if config.optimizer is None:
            raise UserError('no optimizer: add an "optimizer" block to the config (e.g. {"type": "AdamW", '
                            '"params": {"lr": 1e-3}}) or pass optimizer= to shardwise.initialize')
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
        return optimizer(groups)
    raise UserError(f"optimizer= must be a torch.optim.Optimizer or a callable(params), got {type(optimizer)}")


def initialize(model: torch.nn.Module, model_parameters: Iterable[Any] | None = None,
               config: str | os.PathLike | dict | None = None, training_data: Any = None,
               optimizer: Any = None, lr_scheduler: Any = None,
               collate_fn: Callable | None = None, dist_init_required: bool | None = None,
               args: Any = None, config_params: dict | None = None):
    """DeepSpeed's `initialize`: returns (engine, optimizer, dataloader or None, lr_scheduler or None)."""
    config = _config_source(model, config, config_params, args)
    init_distributed()
    ledger = CommLedger()
    world = dist.get_world_size()
    cfg = load_config_for_world(config, world_size=world)     # batch rule with dp = world / (tp * pp)
    mesh = ParallelMesh.build(MeshShape.for_world(world, tp=cfg.tensor_parallel.size, pp=cfg.pipeline.stages))
    device, dtype = _device_for(dist.get_backend()), cfg.precision.dtype.torch_dtype
    _start_identical(model, device, dtype, ledger)
    model_parameters = _tensor_parallel(model, model_parameters, cfg, mesh, ledger)
    model, pipeline = _pipeline(model, cfg, mesh, ledger, device)
    groups = param_groups_of(pipeline.owned(model_parameters) if model_parameters is not None
                             else model.parameters())
    recipe = UpdateRecipe(make_optimizer=lambda g: _make_optimizer(optimizer, cfg, g),
                          scaler=make_loss_scaler(cfg.precision), clip=cfg.gradient_clipping,
                          check_overflow=cfg.precision.checks_overflow, dtype=dtype)
    norms = GradNormReducer.from_mesh(mesh, ledger)
    dp_comm = mesh.comm(Axis.DP, ledger, name="dp")
    updater: Updater
    dp_runtime: DataParallelRuntime
    if cfg.zero.stage == 0:
        updater, dp_runtime = build_replicated(groups, section=cfg.data_parallel, recipe=recipe, dp_comm=dp_comm,
                                               norms=norms)
    else:
        updater, dp_runtime = build_zero(model, groups, section=cfg.zero, recipe=recipe, dp_comm=dp_comm,
                                         norms=norms, device=device, units=pipeline.sharding_units())
    sched = _scheduler(lr_scheduler, cfg, updater.optimizer)
    monitor = TrainingMonitor(cfg.monitors, module=model, ledger=ledger, device=device, global_rank=dist.get_rank(),
                              world_size=world, dp_size=dp_comm.size, mp_size=world // dp_comm.size,
                              micro_batch=cfg.batch.micro_batch, scales_loss=cfg.precision.dtype is DType.FP16)
    engine = Engine(module=model, config=cfg, mesh=mesh, updater=updater, dp_runtime=dp_runtime, pipeline=pipeline,
                    lr_scheduler=sched, ledger=ledger, device=device, compute_dtype=dtype, monitor=monitor)
    loader = None
    if training_data is not None:
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler
        sampler = DistributedSampler(training_data, num_replicas=dp_comm.size, rank=dp_comm.rank,
                                     shuffle=not pipeline.reads_in_order)
        loader = DataLoader(training_data, batch_size=cfg.batch.micro_batch, sampler=sampler,
                            collate_fn=collate_fn, drop_last=True)
        engine.training_dataloader = loader
    return engine, updater.optimizer, loader, sched


def _config_source(model: torch.nn.Module, config: Any, config_params: dict | None, args: Any) -> Any:
    """DeepSpeed's places for the config: config=, config_params=, args.deepspeed_config; a PipelineModule's
    stages and partition become its pipeline block."""
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise UserError("shardwise.initialize needs config= (a DeepSpeed JSON path or dict)")
    if getattr(model, "num_stages", None) is not None and hasattr(model, "pipeline_block"):
        from shardwise.config.load import read_config
        config = model.pipeline_block(read_config(config))   # shardwise.pipe.PipelineModule(num_stages=...)
    return config


def _start_identical(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, ledger: CommLedger) -> None:
    """The model on its device in the training dtype (as DeepSpeed casts it), and the FULL model from world rank 0
    on every rank, before any tensor-parallel slicing: all TP ranks must cut their slices from one model (a
    dp-group broadcast would leave TP peers on different models)."""
    model.to(device)
    if dtype != torch.float32:
        model.to(dtype)
    broadcast_module(model, Comm(None, ledger, name="dp:init"))


def _tensor_parallel(model: torch.nn.Module, model_parameters: Iterable[Any] | None, cfg: EngineConfig,
                     mesh: ParallelMesh, ledger: CommLedger) -> Iterable[Any] | None:
    """Slice the whole model in place (its plan names the full model's modules; under 3D every pipeline stage
    then holds its layers' slices); `model_parameters`, given from the full model, then name the slices."""
    if cfg.tensor_parallel.size == 1:
        return model_parameters
    from shardwise.parallel.tensor_parallel import parallelize_model
    info = parallelize_model(model, mesh.comm(Axis.TP, ledger), sequence_parallel=cfg.tensor_parallel.sequence_parallel)
    return info.remap(model_parameters) if model_parameters is not None else None


def _pipeline(model: torch.nn.Module, cfg: EngineConfig, mesh: ParallelMesh, ledger: CommLedger,
              device: torch.device) -> tuple[torch.nn.Module, Pipeline]:
    """This rank's module and how a global batch runs on it: under a pipeline the rank's stage (every strategy
    built after this sees only the stage's parameters), else the whole model."""
    if cfg.pipeline.stages == 1:
        return model, SingleStage(mesh.comm(Axis.DP, ledger, name="dp:metrics"))
    from shardwise.parallel.pipeline.apply import apply_pipeline
    runner = apply_pipeline(model, section=cfg.pipeline, num_microbatches=cfg.batch.grad_accum, mesh=mesh,
                            ledger=ledger, device=device)
    return runner.stage, runner


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
