"""Sampling from a causal language model on one process: temperature and top-k, no KV cache (each new token
runs the model over the last `seq_len` tokens; enough for the models a CPU trains, and exact for any model)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def logits_of(model: Any, input_ids: Tensor) -> Tensor:
    """Logits [b, s, vocab] of our GPT (`model(ids)`) or of a transformers causal LM (`.logits`)."""
    from shardwise.models.gpt import GPT
    return model(input_ids) if isinstance(model, GPT) else model(input_ids=input_ids).logits


@torch.no_grad()
def generate(model: Any, prompt: Tensor, *, max_new_tokens: int, context: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> Tensor:
    """`prompt` [b, s] followed by `max_new_tokens` sampled tokens, [b, s + max_new_tokens]. temperature 0 is
    greedy (argmax); otherwise logits / temperature, cut to the top_k largest when given, sampled by softmax."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    ids = prompt
    for _ in range(max_new_tokens):
        logits = logits_of(model, ids[:, -context:])[:, -1, :].float()       # [b, vocab]
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]        # [b, 1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, nxt.to(ids.dtype)], dim=1)
    return ids
