"""Reference models: a decoder-only GPT, its config and named presets.

    from shardwise.models import GPT, gpt_config
    model = GPT(gpt_config("tiny", positions="rotary"))
"""

from shardwise.models.gpt import GPT, IGNORE_INDEX, Attention, Block, Embedding, Head, MLP
from shardwise.models.presets import PRESETS, GPTConfig, Positions, gpt_config, gpt_flops_per_token, gpt_num_params

__all__ = [
    "GPT", "GPTConfig", "PRESETS", "Positions", "gpt_config", "gpt_num_params", "gpt_flops_per_token",
    "Attention", "Block", "Embedding", "Head", "MLP", "IGNORE_INDEX",
]
