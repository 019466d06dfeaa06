"""`init_distributed` and `initialize`: build the engine's strategy objects once.

Order of construction (DESIGN.md principle 4): config -> process groups ((pp, dp, tp) mesh) -> device/dtype ->
identical start on every rank (the full model broadcast from rank 0) -> tensor-parallel slicing (of the whole
model) -> pipeline split (this rank's stage) -> fp32 masters (mixed precision) -> optimizer and scheduler ->
gradient sync (over the dp group).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, NoReturn

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.config import load_config_for_world
from shardwise.engine import Engine
from shardwise.errors import UserError
from shardwise.optim import build_optimizer, build_scheduler
from shardwise.parallel.data_parallel import BucketedAllReduce
from shardwise.parallel.tensor_parallel.grads import TensorParallelGrads
from shardwise.parallel.zero.buckets import build_zero_buckets
from shardwise.parallel.zero.grads import ZeroGradReducer
from shardwise.parallel.zero.optimizer import ShardedOptimizer, make_shard_masters
from shardwise.parallel.zero.stage3_build import Stage3Optimizer, ZeroParamRuntime, build_stage3
from shardwise.precision import DType, DynamicLossScaler, LossScaler
from shardwise.replicated_optimizer import ReplicatedOptimizer, make_masters, param_groups_of
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


def _make_scaler(precision: Any) -> LossScaler:
    if precision.dtype != DType.FP16:
        return LossScaler(1.0)
    if not precision.dynamic_loss_scale:
        return LossScaler(precision.static_loss_scale)
    return DynamicLossScaler(init_scale=2.0 ** precision.initial_scale_power,
                             scale_window=precision.loss_scale_window, min_scale=precision.min_loss_scale,
                             hysteresis=precision.hysteresis,
                             consecutive_hysteresis=precision.consecutive_hysteresis)


def _checks_overflow(precision: Any) -> bool:
    """fp16 always skips a step whose gradients hold inf/nan; bf16 does when bf16_check_grad_overflow."""
    return precision.dtype == DType.FP16 or (precision.dtype == DType.BF16 and precision.bf16_check_grad_overflow)


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


def _replicated(cfg: Any, groups: list[dict], optimizer: Any, scaler: LossScaler, dp_comm: Comm,
                dtype: torch.dtype, tp_metrics: Comm | None = None,
                pipeline: Any = None) -> tuple[ReplicatedOptimizer, BucketedAllReduce]:
    """ZeRO stage 0: every rank holds everything (of its tensor-parallel slice of its stage); gradients
    all-reduced in buckets over the dp group. The clipping norm and the overflow verdict are agreed over the
    TP group (`tp_metrics`) and the pipeline's stages (`pipeline`): same interface for both."""
    masters = None
    model_params = [p for g in groups for p in g["params"]]
    tp_grads = None
    if tp_metrics is not None:
        across = pipeline.grads.comm if pipeline is not None else None
        tp_grads = TensorParallelGrads.for_params(tp_metrics, model_params, across=across)
    elif pipeline is not None:
        tp_grads = pipeline.grads
    if dtype != torch.float32:
        groups, model_params, masters = make_masters(groups)
    opt = _make_optimizer(optimizer, cfg, groups)
    step = ReplicatedOptimizer(opt, model_params=model_params, masters=masters, scaler=scaler,
                               clip=cfg.gradient_clipping, check_overflow=_checks_overflow(cfg.precision),
                               tp_grads=tp_grads)
    data_type = cfg.communication.data_type
    sync = BucketedAllReduce(model_params, dp_comm, bucket_numel=cfg.zero.reduce_bucket_size,
                             impl=cfg.communication.all_reduce,
                             predivide_factor=cfg.gradient_predivide_factor, prescale=cfg.prescale_gradients,
                             comm_dtype=data_type.torch_dtype if data_type else None)
    return step, sync


def _zero_1_2(cfg: Any, groups: list[dict], optimizer: Any, scaler: LossScaler, dp_comm: Comm,
              metrics_comm: Comm, dtype: torch.dtype,
              tp_metrics: Comm | None = None) -> tuple[ShardedOptimizer, ZeroGradReducer]:
    """ZeRO stages 1 and 2: optimizer states (and, for 2, gradients) sharded over the dp group (of this
    rank's tensor-parallel slice, when `tp_metrics`, the TP group, is given)."""
    unsupported = {"communication.all_reduce = ring": str(cfg.communication.all_reduce) == "ring",
                   "communication_data_type": cfg.communication.data_type is not None,
                   "prescale_gradients": cfg.prescale_gradients,
                   "gradient_predivide_factor": cfg.gradient_predivide_factor != 1.0}
    given = [k for k, v in unsupported.items() if v]
    if given:
        raise UserError(f"{', '.join(given)}: only supported with zero_optimization.stage 0 for now "
                        f"(ZeRO stage {cfg.zero.stage} reduce-scatters gradients with the backend); remove it")
    buckets = build_zero_buckets([g["params"] for g in groups], dp_size=dp_comm.size, dp_rank=dp_comm.rank,
                                 bucket_numel=cfg.zero.reduce_bucket_size)
    offload = cfg.zero.offload_optimizer if cfg.zero.offloads_optimizer else None
    separate = dtype != torch.float32 or offload is not None
    master_groups, masters = make_shard_masters(
        buckets, groups, separate=separate, offload_device=torch.device("cpu") if offload else None,
        pin_memory=bool(offload and offload.pin_memory))
    opt = _make_optimizer(optimizer, cfg, master_groups)
    tp_grads = None
    if tp_metrics is not None:
        from shardwise.parallel.tensor_parallel.grads import ShardedTensorParallelGrads
        tp_grads = ShardedTensorParallelGrads(tp_metrics, buckets)
    step = ShardedOptimizer(opt, buckets=buckets, masters=masters, separate_masters=separate, comm=dp_comm,
                            flags_comm=metrics_comm, scaler=scaler, clip=cfg.gradient_clipping,
                            check_overflow=_checks_overflow(cfg.precision), tp_grads=tp_grads)
    sync = ZeroGradReducer(buckets, dp_comm, partition_grads=cfg.zero.stage >= 2)
    return step, sync


def _zero_3(cfg: Any, model: torch.nn.Module, groups: list[dict], optimizer: Any, scaler: LossScaler,
            dp_comm: Comm, metrics_comm: Comm, dtype: torch.dtype, device: torch.device,
            tp_metrics: Comm | None = None, pipeline: Any = None) -> tuple[Stage3Optimizer, ZeroParamRuntime]:
    """ZeRO stage 3: parameters sharded too, gathered per unit around its forward and backward."""
    return build_stage3(cfg, model, groups, make_optimizer=lambda g: _make_optimizer(optimizer, cfg, g),
                        scaler=scaler, dp_comm=dp_comm, flags_comm=metrics_comm, dtype=dtype, device=device,
                        check_overflow=_checks_overflow(cfg.precision), tp_comm=tp_metrics,
                        pipeline_stage=pipeline.stage if pipeline is not None else None)


def initialize(model: torch.nn.Module, model_parameters: Iterable[Any] | None = None,
               config: str | os.PathLike | dict | None = None, training_data: Any = None,
               optimizer: Any = None, lr_scheduler: Any = None,
               collate_fn: Callable | None = None, dist_init_required: bool | None = None,
               args: Any = None, config_params: dict | None = None):
    """DeepSpeed's `initialize`: returns (engine, optimizer, dataloader or None, lr_scheduler or None)."""
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise UserError("shardwise.initialize needs config= (a DeepSpeed JSON path or dict)")
    if getattr(model, "num_stages", None) is not None and hasattr(model, "pipeline_block"):
        from shardwise.config.load import read_config
        config = model.pipeline_block(read_config(config))   # shardwise.pipe.PipelineModule(num_stages=...)
    init_distributed()
    ledger = CommLedger()
    world = dist.get_world_size()
    cfg = load_config_for_world(config, world_size=world)     # batch rule with dp = world / tensor_parallel.size
    tp = cfg.tensor_parallel.size
    # (dp, tp) layout, tp innermost; with tp = 1 the dp group is the world and no group is created.
    mesh = ParallelMesh.build(MeshShape.for_world(world, tp=tp, pp=cfg.pipeline.stages))
    dp_comm = mesh.comm(Axis.DP, ledger, name="dp")
    metrics_comm = mesh.comm(Axis.DP, ledger, name="dp:metrics")

    device = _device_for(dist.get_backend())
    dtype = cfg.precision.dtype.torch_dtype
    model.to(device)
    if dtype != torch.float32:
        model.to(dtype)
    # The FULL model from world rank 0 to every rank, before any tensor-parallel slicing: all TP ranks must
    # cut their slices from one model (a DP-group broadcast would leave TP peers on different models).
    broadcast_module(model, Comm(None, ledger, name="dp:init"))
    tp_metrics = None
    if tp > 1:
        # Tensor-parallel slicing of the whole model first: its plan names the full model's modules, and under
        # 3D every pipeline stage then holds its layers' slices (the stage split keeps the modules it is given).
        from shardwise.parallel.tensor_parallel import parallelize_model
        info = parallelize_model(model, mesh.comm(Axis.TP, ledger),
                                 sequence_parallel=cfg.tensor_parallel.sequence_parallel)
        if model_parameters is not None:      # given from the full model: point them at the slices
            model_parameters = info.remap(model_parameters)
        del info                              # releases the full layers' parameters
        tp_metrics = mesh.comm(Axis.TP, ledger, name="tp:metrics")
    pipeline = None
    if cfg.pipeline.stages > 1:
        # Pipeline split (DESIGN principle 4): from here on `model` is this rank's stage, and every strategy
        # below (optimizer, gradient sync over the stage's dp group) sees only the stage's parameters.
        from shardwise.parallel.pipeline.apply import apply_pipeline
        pipeline = apply_pipeline(model, config=cfg, mesh=mesh, ledger=ledger, device=device)
        model = pipeline.stage
        if model_parameters is not None:
            model_parameters = pipeline.owned(model_parameters)

    groups = param_groups_of(model_parameters if model_parameters is not None else model.parameters())
    scaler = _make_scaler(cfg.precision)
    if cfg.zero.stage == 0:
        step, sync = _replicated(cfg, groups, optimizer, scaler, dp_comm, dtype, tp_metrics, pipeline)
    elif cfg.zero.stage == 3:
        step, sync = _zero_3(cfg, model, groups, optimizer, scaler, dp_comm,
                             pipeline.flags_comm if pipeline is not None else metrics_comm, dtype, device, tp_metrics,
                             pipeline)
    else:
        # Under a pipeline the overflow flag and squared norm are reduced over pp x dp (every stage's shards of
        # this TP slice), then, with TP, the slices' part over the TP group.
        step, sync = _zero_1_2(cfg, groups, optimizer, scaler, dp_comm,
                               pipeline.flags_comm if pipeline is not None else metrics_comm, dtype, tp_metrics)
    opt = step.optimizer
    sched = lr_scheduler
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        sched = lr_scheduler(opt)
    elif sched is None and cfg.scheduler is not None:
        sched = build_scheduler(cfg.scheduler, opt)
    engine = Engine(module=model, config=cfg, optimizer_step=step, grad_sync=sync, lr_scheduler=sched,
                    dp_comm=dp_comm, metrics_comm=metrics_comm, ledger=ledger, device=device,
                    compute_dtype=dtype, pipeline=pipeline, tp_comm=tp_metrics)
    loader = None
    if training_data is not None:
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler
        # DeepSpeed's PipelineEngine reads its training data in order (shuffle=False); its plain engine shuffles
        sampler = DistributedSampler(training_data, num_replicas=dp_comm.size, rank=dp_comm.rank,
                                     shuffle=pipeline is None)
        loader = DataLoader(training_data, batch_size=cfg.batch.micro_batch, sampler=sampler,
                            collate_fn=collate_fn, drop_last=True)
        engine.training_dataloader = loader
    return engine, opt, loader, sched


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
