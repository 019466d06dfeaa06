"""What an accepted config holds that does nothing: one warning line per setting.

DeepSpeed accepts these without acting on them (or acts on things shardwise does not have), so refusing them
would reject working DeepSpeed configs; staying silent would hide that they do nothing.
"""

from __future__ import annotations

from shardwise.config.deepspeed_blocks import no_effect_warnings
from shardwise.config.schema import ConfigModel
from shardwise.config.zero import OFFLOAD_MIN_STAGE


def _offload_below_its_stage(model: ConfigModel) -> list[str]:
    zero = model.zero_optimization
    lines = []
    for name in ("offload_param", "offload_optimizer"):
        block, needed = getattr(zero, name), OFFLOAD_MIN_STAGE[name]
        if block is not None and block.device != "none" and zero.stage < needed:
            lines.append(f'"zero_optimization.{name}" has no effect at zero_optimization.stage {zero.stage} '
                         f'(it needs stage >= {needed}; DeepSpeed ignores it too); ignored')
    return lines


def _pipeline_tuning(model: ConfigModel) -> list[str]:
    given = model.pipeline.model_fields_set & {"seed_layers", "pipe_partitioned", "grad_partitioned"}
    return [f'"pipeline.{name}" tunes DeepSpeed\'s own pipeline engine and changes no result; ignored'
            for name in sorted(given)]


def _autotp_keys(model: ConfigModel) -> list[str]:
    given = model.tensor_parallel.model_fields_set - {"size", "sequence_parallel"}
    return [f'"tensor_parallel.{name}" tunes DeepSpeed\'s AutoTP; shardwise\'s tensor-parallel plans split the '
            f'layers themselves; ignored' for name in sorted(given)]


def _autoep_keys(model: ConfigModel) -> list[str]:
    given = sorted(model.expert_parallel.model_extra or {})
    return [f'"expert_parallel.{name}" tunes DeepSpeed\'s AutoEP; shardwise routes with the model\'s own MoE '
            f'layers; ignored' for name in given]


def ignored_settings(model: ConfigModel) -> list[str]:
    """One line per setting of `model` that is accepted but changes nothing in shardwise."""
    return [*no_effect_warnings(model), *_offload_below_its_stage(model), *_pipeline_tuning(model),
            *_autotp_keys(model), *_autoep_keys(model)]
