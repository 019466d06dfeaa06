"""Valid configs that this version of shardwise cannot run yet.

# ---------------------------------------------------------------------------------------------
# NOT-YET FEATURES: every refusal lives in `refuse_unimplemented` below. When a feature lands,
# delete its check here (and its test in tests/unit/test_config.py); nothing else gates it.
# ---------------------------------------------------------------------------------------------
"""

from __future__ import annotations

from shardwise.config.errors import ConfigProblem
from shardwise.config.schema import ConfigModel


def refuse_unimplemented(model: ConfigModel) -> list[ConfigProblem]:
    """The problems of a schema-valid config that asks for something not implemented yet."""
    problems: list[ConfigProblem] = []
    zero = model.zero_optimization

    def refuse(key: str, message: str) -> None:
        problems.append(ConfigProblem(key, message))

    for name, block in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param)):
        if block is None or block.device == "none":
            continue
        key = f"zero_optimization.{name}.device"
        needed = 3 if name == "offload_param" else 1
        what = "parameter" if name == "offload_param" else "optimizer"
        if zero.stage < needed:   # an invalid combination, not a missing feature
            refuse(key, f'{key} = "{block.device}": {what} offloading needs zero_optimization.stage >= {needed} '
                        f'(it is {zero.stage}); raise the stage or set the device to "none"')
        elif block.device != "cpu":
            refuse(key, f'{key} = "{block.device}": only "cpu" offloading is implemented; use "cpu" or "none"')
    if zero.stage >= 1:
        # ZeRO reduce-scatters with the backend in the gradients' dtype; stage 0's all-reduce options do not
        # reach it. Refused rather than ignored: each would silently change what is reduced.
        stage0_only = {"communication.all_reduce": model.communication.all_reduce == "ring",
                       "communication_data_type": model.communication_data_type is not None,
                       "prescale_gradients": model.prescale_gradients,
                       "gradient_predivide_factor": model.gradient_predivide_factor != 1.0}
        for key, given in stage0_only.items():
            if given:
                refuse(key, f"{key} is only supported with zero_optimization.stage 0 for now (ZeRO stage "
                            f"{zero.stage} reduce-scatters gradients with the backend); remove it")
    if zero.zenflow is not None:
        refuse("zero_optimization.zenflow", "zero_optimization.zenflow: ZenFlow is not implemented; remove it")
    checkpointing = model.activation_checkpointing
    for name in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
        if getattr(checkpointing, name):
            refuse(f"activation_checkpointing.{name}",
                   f"activation_checkpointing.{name} = true: not implemented yet in this version; use false "
                   f'(recomputation itself is "activation_checkpointing.policy")')
    if checkpointing.policy != "none":
        refuse("activation_checkpointing.policy",
               f'activation_checkpointing.policy = "{checkpointing.policy}": activation recomputation is not '
               f'implemented yet in this version; use "none"')
    if model.flops_profiler.enabled and model.pipeline.stages > 1:
        # The schedule runs the stage's forwards itself; the profiler hooks engine.forward.
        refuse("flops_profiler.enabled", "flops_profiler.enabled = true: the flops profiler is not implemented "
                                         "under a pipeline (pipeline.stages > 1) yet; set it to false")
    return problems
