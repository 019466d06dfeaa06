"""Activation recomputation: keep a module's inputs, drop what its forward saved, run it again in backward.

Which modules (`plan_recompute`, from the "activation_checkpointing" config block):
- "full": every transformer block keeps only its input [b, s, h]; the whole block runs again in backward.
- "every_n" with "every": N: blocks N, 2N, ... (1-based) of each stage; with "blocks": K, the first K blocks of
  each pipeline stage (Megatron's "block" method). Memory and time in between "none" and "full".
- "selective": only the attention core (QK^T, softmax, its dropout, attention over V; modules that declare
  `is_attention_core = True`, the built-in GPT's `CoreAttention`). With `scaled_dot_product_attention` the core
  never stores the [b, a, s, s] scores and probabilities that make this policy worthwhile in Korthikanti et
  al. (2022): the fused kernels keep q, k, v [b, a, s, d], the output and a logsumexp [b, a, s]. Recomputing the
  core therefore keeps q, k, v (its inputs) and drops only the output copy and the logsumexp: a small saving.

Blocks are the modules `Pipeline.blocks()` names: the children of the model's largest ModuleList (as for the
ZeRO-3 units), or a pipeline stage's partitioned layers, so each stage recomputes its own chunks.

Exactness: the recomputation replays the forward's random numbers. torch's checkpoint restores the default
generators (CPU and the inputs' CUDA devices); a module that draws from a tensor-parallel rank's own stream
(`tensor_parallel.random`) gets that stream rewound to where the forward found it, and put back after, so the
live stream is untouched (other micro-batches' forwards may have advanced it meanwhile). Losses and gradients
are then bitwise those of the run without recomputation (fp32, CPU).

Composition: the module's own forward hooks (ZeRO-3's gather and free of a unit, TP's stream fork) stay outside
the recomputed function, so a unit is gathered again in backward by ZeRO-3's backward hook before its forward
is replayed; the hooks of submodules run again during the replay.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.config.resolved import ActivationCheckpointingConfig, RecomputePolicy
from shardwise.errors import UserError
from shardwise.parallel.tensor_parallel.random import TP_RNG_ATTR, TensorParallelRNG

RECOMPUTED_ATTR = "_shardwise_recomputed"


class _Kept(torch.autograd.Function):
    """Identity that saves its input for backward. The recomputed function holds its inputs itself (torch's
    non-reentrant checkpoint keeps them in its closure); saving them here as well costs nothing (the same
    storage) and makes the activation meters, which watch what autograd saves, count them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _kept(value: Any) -> Any:
    if torch.is_tensor(value) and value.requires_grad and value.is_floating_point():
        return _Kept.apply(value)
    return value


def _replaying(fn: Callable[..., Any], rngs: list[TensorParallelRNG]) -> Callable[..., Any]:
    """`fn` whose second and later calls (the recomputation) start every TP stream where the first call found it,
    and leave the streams as they were before the replay."""
    if not rngs:
        return fn
    start = [r.local_state.clone() for r in rngs]
    calls = 0

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*args, **kwargs)
        live = [r.local_state for r in rngs]
        for r, s in zip(rngs, start):
            r.local_state = s.clone()
        try:
            return fn(*args, **kwargs)
        finally:
            for r, s in zip(rngs, live):
                r.local_state = s

    return run


def recompute_module(module: nn.Module) -> None:
    """Make `module`'s forward recompute in backward (an instance attribute over its class's forward, so names,
    hooks and state dicts are unchanged). Under no_grad it runs as before. Idempotent."""
    if getattr(module, RECOMPUTED_ATTR, False):
        return
    original = module.forward
    rngs = list({id(r): r for m in module.modules()
                 if (r := getattr(m, TP_RNG_ATTR, None)) is not None}.values())

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        args = tuple(_kept(a) for a in args)
        return checkpoint(_replaying(original, rngs), *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    module.forward = forward
    setattr(module, RECOMPUTED_ATTR, True)


def plan_recompute(blocks: list[nn.Module], section: ActivationCheckpointingConfig) -> list[nn.Module]:
    """The modules `section.policy` recomputes among `blocks` (this rank's: its pipeline stage's, in forward
    order, so "first K" and "every N-th" count per stage)."""
    policy = section.policy
    if policy is RecomputePolicy.NONE:
        return []
    if policy is RecomputePolicy.FULL:
        return list(blocks)
    if policy is RecomputePolicy.EVERY_N:
        if section.blocks is not None:
            return list(blocks[:section.blocks])
        n = section.every or 1
        return [b for i, b in enumerate(blocks) if (i + 1) % n == 0]
    cores = [m for b in blocks for m in b.modules() if getattr(m, "is_attention_core", False)]
    if blocks and not cores:
        raise UserError('activation_checkpointing.policy = "selective" needs attention cores as modules (the '
                        'built-in GPT\'s CoreAttention, or a module with is_attention_core = True); this model has '
                        'none: use "full" or "every_n"')
    return cores


def apply_recompute(blocks: list[nn.Module], section: ActivationCheckpointingConfig) -> list[nn.Module]:
    """Recompute what the policy names; returns those modules."""
    chosen = plan_recompute(blocks, section)
    for m in chosen:
        recompute_module(m)
    return chosen
