"""Valid configs that this version of shardwise cannot run yet.

# ---------------------------------------------------------------------------------------------
# NOT-YET FEATURES: every refusal lives in `refuse_unimplemented` below. When a feature lands,
# delete its check here (and its cases in tests/unit/test_config*.py); nothing else gates it.
# ---------------------------------------------------------------------------------------------
"""

from __future__ import annotations

from shardwise.config.deepspeed_blocks import data_types_changed, enabled_blocks
from shardwise.config.errors import ConfigProblem, show
from shardwise.config.schema import AllReduceImpl, ConfigModel

# DeepSpeed features shardwise does not have, by their config block: what each is. Refused only when on.
FEATURE_NAMES = {
    "comet": "Comet monitor",
    "autotuning": "autotuner", "hybrid_engine": "hybrid (RLHF) engine", "data_efficiency": "data efficiency library",
    "torch_autocast": "torch.autocast mode",
    "weight_quantization": "weight quantization", "compile": "DeepCompile",
    "datastates_ckpt": "DataStates checkpointing",
}


def _how_to_switch_off(name: str) -> str:
    if name == "weight_quantization":
        return 'remove "weight_quantization.quantized_initialization" (or the block)'
    if name == "compile":
        return 'set "compile.deepcompile": false or remove the block'
    if name == "datastates_ckpt":
        return 'remove the block or set it to false'
    return f'set "{name}.enabled": false or remove the block'


def refuse_unimplemented(model: ConfigModel) -> list[ConfigProblem]:
    """The problems of a schema-valid config that asks for something not implemented yet."""
    problems: list[ConfigProblem] = []
    zero = model.zero_optimization

    def refuse(key: str, message: str) -> None:
        problems.append(ConfigProblem(key, message))

    # Below its stage an offload block is ignored (it does not offload), as DeepSpeed ignores it; ignored.py warns.
    for name, offloads in (("offload_optimizer", zero.offloads_optimizer), ("offload_param", zero.offloads_params)):
        device = getattr(zero, name).device if offloads else "none"
        if device not in ("none", "cpu"):
            key = f"zero_optimization.{name}.device"
            refuse(key, f'{key} = "{device}": only "cpu" offloading is implemented; use "cpu" or "none"')
    optimizer_offload = zero.offload_optimizer
    if optimizer_offload is not None and zero.offloads_optimizer:
        if optimizer_offload.ratio < 1.0:
            refuse("zero_optimization.offload_optimizer.ratio",
                   f'"zero_optimization.offload_optimizer.ratio" = {optimizer_offload.ratio:g}: partial optimizer '
                   f'offload is not implemented; use 1 (all of it)')
        if optimizer_offload.super_offload:
            refuse("zero_optimization.offload_optimizer.super_offload",
                   '"zero_optimization.offload_optimizer.super_offload": true: SuperOffload is not implemented; '
                   'use false')
    # ZeRO++ (DeepSpeed acts on it at stage 3 only): quantized collectives change what is communicated, hpZ
    # where parameters live.
    for name in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        if getattr(zero, name) and zero.stage == 3:
            refuse(f"zero_optimization.{name}", f'"zero_optimization.{name}": true: ZeRO++ quantized communication '
                                                f'is not implemented; use false')
    if zero.zero_hpz_partition_size > 1 and zero.stage == 3:
        refuse("zero_optimization.zero_hpz_partition_size",
               f'"zero_optimization.zero_hpz_partition_size" = {zero.zero_hpz_partition_size}: ZeRO++ hierarchical '
               f'partitioning is not implemented; use 1')
    if zero.stage >= 1:
        # ZeRO reduce-scatters with the backend in the gradients' dtype; stage 0's all-reduce options do not
        # reach it. Refused rather than ignored: each would silently change what is reduced.
        stage0_only = {"communication.all_reduce": model.communication.all_reduce is not AllReduceImpl.BACKEND,
                       "communication_data_type": model.communication_data_type is not None,
                       "prescale_gradients": model.prescale_gradients,
                       "gradient_predivide_factor": model.gradient_predivide_factor != 1.0}
        for key, given in stage0_only.items():
            if given:
                refuse(key, f"{key} is only supported with zero_optimization.stage 0 for now (ZeRO stage "
                            f"{zero.stage} reduce-scatters gradients with the backend); remove it")
    for name in enabled_blocks(model):
        refuse(name, f'"{name}" is on, but shardwise does not implement DeepSpeed\'s {FEATURE_NAMES[name]}; '
                     f'{_how_to_switch_off(name)}')
    data_types = model.data_types or {}
    for name in data_types_changed(model):
        key = f"data_types.{name}"
        refuse(key, f'"{key}" = {show(data_types[name])}: choosing dtypes per tensor kind is not implemented; '
                    f'remove it (the training dtype comes from "fp16"/"bf16")')
    if model.gradient_allreduce_op == "sum":
        refuse("gradient_allreduce_op", '"gradient_allreduce_op" = "sum": only averaged gradients are implemented; '
                                        'use "mean" or remove it')
    if model.pipeline.activation_checkpoint_interval > 0:
        refuse("pipeline.activation_checkpoint_interval",
               f'"pipeline.activation_checkpoint_interval" = {model.pipeline.activation_checkpoint_interval}: '
               f'checkpointing every n pipeline layers is not implemented; use 0')
    if zero.zenflow is not None:
        refuse("zero_optimization.zenflow", "zero_optimization.zenflow: ZenFlow is not implemented; remove it")
    return problems
