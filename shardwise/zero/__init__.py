"""DeepSpeed's `deepspeed.zero` names for scripts:

    with shardwise.zero.Init(config_dict_or_path=ds_config):
        model = GPT(cfg)                        # built sharded: no rank ever holds the whole model
    with shardwise.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        ...                                     # whole on every rank; rank 0's changes kept on exit
"""

from shardwise.zero.gathered import GatheredParameters
from shardwise.zero.init import Init

__all__ = ["GatheredParameters", "Init"]
