"""DeepSpeed's `deepspeed.zero` names for scripts (`import shardwise as deepspeed`):

    with shardwise.zero.Init(config_dict_or_path=ds_config):
        model = AutoModelForCausalLM.from_config(cfg)   # sharded as it is constructed: no rank holds it whole
    with shardwise.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        ...                                     # whole on every rank; rank 0's changes kept on exit

Re-exports only; the implementation is `shardwise.parallel.zero` (`init_context.py`, `construction.py`,
`gathered.py`).
"""

from shardwise.parallel.zero.gathered import GatheredParameters
from shardwise.parallel.zero.init_context import Init

__all__ = ["GatheredParameters", "Init"]
