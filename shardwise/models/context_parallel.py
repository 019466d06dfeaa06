"""How the built-in GPT (and its Llama-style form) runs under context parallelism: its hook, beside the model, so
that `shardwise.parallel.context` knows no model.

    check_model_for_context_parallel(model, section)   # before any rank starts work: one line if it cannot
    apply_context_parallel(model, cp)                  # after the mesh: cp attention, positions, loss

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
from shardwise.parallel.context import ContextParallel, ContextParallelCore, check_context_parallel


def check_model_for_context_parallel(model: nn.Module, section: ContextParallelConfig) -> None:
    """Raise one line when `model` cannot run with `section` (its sequence, its heads, a model without a hook)."""
    if section.size == 1:
        return
    if not isinstance(model, GPT):
        raise UserError(f"context_parallel.size = {section.size}: {type(model).__name__} has no context-parallel "
                        f"attention hook (the built-in GPT and Llama presets have one); use one of them or "
                        f"context_parallel.size 1")
    cfg = model.cfg
    if cfg.moe_experts:
        raise UserError(f"context_parallel.size = {section.size} with an MoE model (moe_experts = {cfg.moe_experts}) "
                        f"is not supported yet: use context_parallel.size 1")
    assert cfg.n_kv_head is not None    # GPTConfig resolves it
    check_context_parallel(section, heads=cfg.n_head, kv_heads=cfg.n_kv_head, seq_len=cfg.seq_len,
                           attention_dropout=cfg.dropout)


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> None:
    """Install `cp` in a GPT checked by `check_model_for_context_parallel`, in place."""
    assert isinstance(model, GPT), type(model)
    positions = cp.layout.positions
    model.embed.position_ids = positions
    for attn in (m for m in model.modules() if isinstance(m, Attention)):
        attn.core = ContextParallelCore(cp.attention)
        attn.position_ids = positions
    # Shadows the static GPT.loss on this instance only (an instance attribute the checker cannot follow).
    model.loss = cp.mean_loss(GPT.token_loss_sum, ignore_index=IGNORE_INDEX)  # type: ignore[method-assign]
