"""DeepSpeed's `deepspeed.moe` for scripts (`import shardwise as deepspeed`): `moe.layer.MoE` and
`moe.utils` (`split_params_into_different_moe_groups_for_optimizer`, `is_moe_param`, ...), over
`shardwise.parallel.experts`."""

from shardwise.moe import layer, utils

__all__ = ["layer", "utils"]
