"""A plan as a DeepSpeed-style config for `shardwise train` (the schema of `shardwise.config`)."""

from __future__ import annotations

import json
import os
from typing import Any

from shardwise.planner.specs import JobSpec, Offload, Optimizer, Plan, PlannerError, Precision, Recompute

DEFAULT_LR = 3e-4
"""The planner does not choose a learning rate; this is a common starting point for Adam on GPTs."""


def _optimizer_block(optimizer: Optimizer, lr: float) -> dict[str, Any]:
    if optimizer is Optimizer.ADAM:
        return {"type": "AdamW", "params": {"lr": lr}}
    if optimizer is Optimizer.SGD_MOMENTUM:
        return {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}}
    return {"type": "SGD", "params": {"lr": lr}}


def deepspeed_config(plan: Plan, job: JobSpec, *, lr: float = DEFAULT_LR) -> dict[str, Any]:
    """The config that runs `plan` for `job`: batch triple, precision, optimizer, ZeRO stage and
    offload, tensor, pipeline and context parallel blocks, recomputation policy."""
    m = plan.grad_accum(job)
    if m < 1 or m * plan.dp * plan.micro_batch != job.global_batch:
        raise PlannerError(f"cannot write a config: global batch {job.global_batch} is not dp * micro_batch * "
                           f"accumulation = {plan.dp} * {plan.micro_batch} * m for a whole m")
    if plan.ep > 1:
        # the config has no expert-parallel size yet: written without it, the run would hold every expert
        raise PlannerError(f"cannot write a config for plan.ep = {plan.ep}: the config has no expert-parallel "
                           f"size; evaluate the plan with --ep 1, or build the model with shard_experts(model, "
                           f"build_expert_groups({plan.ep})) before initialize and write the rest by hand")
    zero: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.offload is not Offload.NONE:
        zero["offload_optimizer"] = {"device": "cpu"}
    if plan.offload is Offload.OPTIMIZER_AND_PARAMS:
        zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_batch_size": job.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": m,
        "optimizer": _optimizer_block(job.optimizer, lr),
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
    }
    if job.precision is Precision.BF16:
        config["bf16"] = {"enabled": True}
    elif job.precision is Precision.FP16:
        config["fp16"] = {"enabled": True}
    if plan.tp > 1:
        config["tensor_parallel"] = {"size": plan.tp, "sequence_parallel": plan.sequence_parallel}
    if plan.pp > 1:
        config["pipeline"] = {"stages": plan.pp, "schedule": plan.schedule.value,
                              "virtual_stages": plan.virtual_stages}
    if plan.cp > 1:
        config["context_parallel"] = {"size": plan.cp, "impl": plan.cp_impl.value}
    if plan.recompute is not Recompute.NONE:
        config["activation_checkpointing"] = {"policy": plan.recompute.value}
    return config


def write_config(path: str | os.PathLike, plan: Plan, job: JobSpec, *, lr: float = DEFAULT_LR) -> dict[str, Any]:
    config = deepspeed_config(plan, job, lr=lr)
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise PlannerError(f"--write-config {os.fspath(path)!r}: cannot write: {e.strerror or e}") from None
    return config
