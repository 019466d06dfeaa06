"""How the built-in GPT (and its Llama-style form) runs under context parallelism: its hook, beside the model, so
that `shardwise.parallel.context` knows no model. Hugging Face decoders have theirs in `hf_context_parallel.py`;
the two functions here take either.

    check_model_for_context_parallel(model, section)   # before any rank starts work: one line if it cannot
    apply_context_parallel(model, cp) -> BatchPart     # after the mesh: cp attention, positions, loss

The hook changes three things of the model instance and nothing else: every block's attention core becomes the cp
attention (`ContextParallelCore`: ring or Ulysses over this rank's part of the sequence), the token positions that
learned position tables and rotary angles read become those of the tokens this rank holds, and `model.loss` becomes
the mean over the micro-batch's valid tokens on all cp ranks. Parameters are untouched, so checkpoints are too.
"""

from __future__ import annotations

from torch import nn

from shardwise.config.schema import ContextParallelConfig
from shardwise.errors import UserError
from shardwise.models.gpt import GPT, IGNORE_INDEX, Attention
from shardwise.models.hf_context_parallel import (
    apply_hf_context_parallel, check_hf_model_for_context_parallel, is_hf_decoder,
)
from shardwise.parallel.context import BatchPart, ContextParallel, ContextParallelCore, check_context_parallel


def check_model_for_context_parallel(model: nn.Module, section: ContextParallelConfig, *, tp: int = 1) -> None:
    """Raise one line when `model` cannot run with `section` (its sequence, its heads, a model without a hook);
    with `tp` > 1 the heads are those of one tensor-parallel rank (what Ulysses spreads over the cp ranks)."""
    if section.size == 1:
        return
    if is_hf_decoder(model):
        check_hf_model_for_context_parallel(model, section, tp=tp)
        return
    if not isinstance(model, GPT):
        raise UserError(f"context_parallel.size = {section.size}: {type(model).__name__} has no context-parallel "
                        f"attention hook (the built-in GPT and Llama presets and Hugging Face decoders have one); "
                        f"use one of them or context_parallel.size 1")
    cfg = model.cfg
    if cfg.moe_experts:
        raise UserError(f"context_parallel.size = {section.size} with an MoE model (moe_experts = {cfg.moe_experts}) "
                        f"is not supported yet: use context_parallel.size 1")
    assert cfg.n_kv_head is not None    # GPTConfig resolves it
    check_context_parallel(section, heads=max(cfg.n_head // tp, 1), kv_heads=max(cfg.n_kv_head // tp, 1),
                           seq_len=cfg.seq_len, attention_dropout=cfg.dropout)


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> BatchPart:
    """Install `cp` in a model checked by `check_model_for_context_parallel`, in place; how the step driver takes
    this rank's part of a micro-batch."""
    if is_hf_decoder(model):
        return apply_hf_context_parallel(model, cp)
    assert isinstance(model, GPT), type(model)
    positions = cp.layout.positions
    model.embed.position_ids = positions
    for attn in (m for m in model.modules() if isinstance(m, Attention)):
        attn.core = ContextParallelCore(cp.attention)
        attn.position_ids = positions
    # Shadows the static GPT.loss on this instance only (an instance attribute the checker cannot follow).
    # Under tensor parallelism the loss installed before is vocabulary-parallel: its token sum is the one to add up.
    token_loss_sum = getattr(model.loss, "token_loss_sum", GPT.token_loss_sum)
    model.loss = cp.mean_loss(token_loss_sum, ignore_index=IGNORE_INDEX)  # type: ignore[method-assign]
    return cp
