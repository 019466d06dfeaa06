"""Activation recomputation: keep a module's inputs, drop what its forward saved, run it again in backward.

    apply_recompute(pipeline.blocks(model), cfg.activation_checkpointing)   # "full", "every_n" or "selective"

The replay is exact: it replays the forward's random numbers (`_RandomStreams`), so losses and gradients are
bitwise those of the run without recomputation (fp32, CPU).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.comm.collectives import Comm
from shardwise.config import ActivationCheckpointingConfig, RecomputePolicy
from shardwise.errors import UserError
from shardwise.parallel.tensor_parallel.random import TP_RNG_ATTR, TensorParallelRNG, get_cuda_rng_tracker

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


def _replaying(fn: Callable[..., Any], streams: _RandomStreams) -> Callable[..., Any]:
    """`fn` whose second and later calls (the recomputation) start every stream of `streams` where the first call
    found it, and leave the streams as they were before the replay (other forwards may have moved them since)."""
    start = streams.capture()
    calls = 0

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*args, **kwargs)
        live = streams.capture()
        streams.restore(start)
        try:
            return fn(*args, **kwargs)
        finally:
            streams.restore(live)

    return run


def recompute_module(module: nn.Module, stored: StoredInputs | None = None) -> None:
    """Make `module`'s forward recompute in backward (an instance attribute over its class's forward, so names,
    hooks and state dicts are unchanged). Under no_grad it runs as before. Idempotent. `stored`: how inputs are
    kept (partitioned, on the host...); by default torch's non-reentrant checkpoint keeps them whole.

    The module's own forward hooks (ZeRO-3's gather and free of a unit, TP's stream fork) stay outside the
    recomputed function, so a unit is gathered again in backward by ZeRO-3's backward hook before its forward is
    replayed; the hooks of submodules run again during the replay."""
    if getattr(module, RECOMPUTED_ATTR, False):
        return
    original = module.forward
    rngs = list({id(r): r for m in module.modules()
                 if (r := getattr(m, TP_RNG_ATTR, None)) is not None}.values())

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if stored is not None and not stored.plain:
            return checkpoint_function(original, args, kwargs, stored, rngs)
        args = tuple(_kept(a) for a in args)
        # torch's checkpoint restores the default generators; the TP and tracker streams are rewound here
        streams = _RandomStreams(rngs, defaults=False)
        return checkpoint(_replaying(original, streams), *args, use_reentrant=False, preserve_rng_state=True,
                          **kwargs)

    module.forward = forward
    setattr(module, RECOMPUTED_ATTR, True)


def recompute_call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` recomputed in backward by torch's non-reentrant checkpoint: its tensor arguments
    are kept (and counted, see `_Kept`), what it saves itself is dropped. Under no_grad it is a plain call."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    args = tuple(_kept(a) for a in args)
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


class AttentionFunctions(Protocol):
    """What a model family beside the models tells recomputation about its layers. Attention cores that are
    functions, not modules: the attention layers of some families look their core up at each call (Hugging Face's,
    by `config._attn_implementation`), so that "selective" can recompute those functions (with `recompute_call`).
    And blocks that write state outside themselves as they run (a key/value cache): a recomputed block runs twice,
    so such writes must be switched off for it (`prepare_blocks`)."""

    def found_in(self, blocks: list[nn.Module]) -> bool:
        """Do `blocks` hold attention layers whose core this rewires?"""
        ...

    def recompute(self, blocks: list[nn.Module]) -> None:
        """Make the attention cores of `blocks` recompute in backward."""
        ...

    def prepare_blocks(self, blocks: list[nn.Module]) -> None:
        """`blocks` are about to be recomputed whole: in training under autograd they must run the same way twice
        (no cache written by the forward and read back, longer, by the replay)."""
        ...


def plan_recompute(blocks: list[nn.Module], section: ActivationCheckpointingConfig, *,
                   attention_functions: AttentionFunctions | None = None) -> list[nn.Module]:
    """The modules `section.policy` recomputes among `blocks` (this rank's: its pipeline stage's, in forward
    order, so "first K" and "every N-th" count per stage). "selective" without attention-core modules is an
    error unless `attention_functions` finds function cores in `blocks`.

    Blocks are the modules `Pipeline.blocks()` names: the children of the model's largest ModuleList (as for the
    ZeRO-3 units), or a pipeline stage's partitioned layers, so each stage recomputes its own chunks.
    - "full": every transformer block keeps only its input [b, s, h]; the whole block runs again in backward.
    - "every_n" with "every": N: blocks N, 2N, ... (1-based) of each stage; with "blocks": K, the first K blocks
      of each pipeline stage (Megatron's "block" method). Memory and time in between "none" and "full".
    - "selective": only the attention core (QK^T, softmax, its dropout, attention over V; modules that declare
      `is_attention_core = True`, the built-in GPT's `CoreAttention`; or, where the core is a function the
      attention layers look up at each call, what the caller's `AttentionFunctions` rewires: Hugging Face's,
      beside the models). With `scaled_dot_product_attention` the core never stores the [b, a, s, s] scores and
      probabilities that make this policy worthwhile in Korthikanti et al. (2022): the fused kernels keep q, k, v
      [b, a, s, d], the output and a logsumexp [b, a, s]. Recomputing the core therefore keeps q, k, v (its
      inputs) and drops only the output copy and the logsumexp: a small saving.
    """
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
    if blocks and not cores and not (attention_functions is not None and attention_functions.found_in(blocks)):
        raise UserError('activation_checkpointing.policy = "selective" needs attention cores as modules (the '
                        'built-in GPT\'s CoreAttention, or a module with is_attention_core = True) or Hugging Face '
                        'attention layers; this model has neither: use "full" or "every_n"')
    return cores


def apply_recompute(blocks: list[nn.Module], section: ActivationCheckpointingConfig, *,
                    partition_group: Any = None, times: list | None = None,
                    attention_functions: AttentionFunctions | None = None) -> list[nn.Module]:
    """Recompute what the policy names; returns those modules. DeepSpeed's keys shape how inputs are kept:
    `partition_activations` spreads each over `partition_group` (the TP group, when the blocks' inputs are
    replicated over it), `cpu_checkpointing` keeps them on the host, `synchronize_checkpoint_boundary`
    synchronizes the device around each, `profile` appends each run's time to `times`. Under "selective", blocks
    without attention-core modules have their function cores recomputed by `attention_functions`."""
    stored = StoredInputs(group=partition_group if section.partition_activations else None,
                          cpu=section.cpu_checkpointing, synchronize=section.synchronize_checkpoint_boundary,
                          times=times if section.profile else None)
    chosen = plan_recompute(blocks, section, attention_functions=attention_functions)
    whole = [m for m in chosen if m in blocks]      # "selective" chooses cores inside the blocks instead
    if whole and attention_functions is not None:
        attention_functions.prepare_blocks(whole)
    for m in chosen:
        recompute_module(m, stored)
    if section.policy is RecomputePolicy.SELECTIVE and not chosen and attention_functions is not None:
        attention_functions.recompute(blocks)
    return chosen


# -- recomputation with stored inputs under our control (partitioned, on the host) ---------------------------

@dataclass(frozen=True)
class StoredInputs:
    """How a checkpoint keeps its inputs until the replay. `group`: the model-parallel `Comm` over which each
    input [any shape], replicated there, is kept as 1/t of its elements per rank and all-gathered before the
    replay (None: whole). `cpu`: kept in host memory (pinned on CUDA) and copied back. `synchronize`: the device
    is synchronized at the start and end of the forward and of the replay. `times`: a list that receives
    ("forward" | "replay", seconds) of each run of the function (DeepSpeed's "profile")."""

    group: Comm | None = None
    cpu: bool = False
    synchronize: bool = False
    times: list | None = None

    @property
    def plain(self) -> bool:
        """Nothing asked of the stored inputs: torch's own checkpoint does the job."""
        return self.group is None and not self.cpu and not self.synchronize and self.times is None

    @property
    def _partition_group(self) -> Comm | None:
        """The group stored inputs are split over; None: they are kept whole."""
        return self.group if self.group is not None and self.group.size > 1 else None

    def keep(self, t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """What to save of input `t` and how to rebuild it: (saved tensor, (shape, numel, device))."""
        meta = (t.shape, t.numel(), t.device)
        kept = t.detach()
        group = self._partition_group
        if group is not None:
            size, rank = group.size, group.rank
            part = -(-t.numel() // size)
            flat = kept.reshape(-1)
            if part * size != t.numel():                   # pad to equal parts: all_gather takes equal sizes
                flat = torch.cat([flat, flat.new_zeros(part * size - t.numel())])
            kept = flat[rank * part:(rank + 1) * part].clone()   # [numel / t]: this rank's part, its own storage
        if self.cpu:
            host = torch.empty(kept.shape, dtype=kept.dtype, device="cpu",
                               pin_memory=kept.is_cuda)
            kept = host.copy_(kept, non_blocking=kept.is_cuda)
        return kept, meta

    def restore(self, kept: torch.Tensor, meta: tuple) -> torch.Tensor:
        shape, numel, device = meta
        t = kept.to(device, non_blocking=True) if kept.device != device else kept
        group = self._partition_group
        if group is not None:
            full = torch.empty(t.numel() * group.size, dtype=t.dtype, device=t.device)
            group.all_gather_into_tensor(full, t.contiguous())
            t = full[:numel]
        return t.reshape(shape)

    def sync(self, device: torch.device) -> None:
        if self.synchronize and device.type == "cuda":
            torch.cuda.synchronize(device)


class _RandomStreams:
    """Every stream a replay must find where the forward found it: DeepSpeed-style tracker streams, shardwise's
    tensor-parallel streams, and with `defaults` the CPU generator and the CUDA generator of the current device
    (torch's own checkpoint restores those two itself: the default generators of the CPU and the inputs' CUDA
    devices). A stream is rewound to where the forward found it and put back after the replay, so the live stream
    is untouched (other micro-batches' forwards may have advanced it meanwhile)."""

    def __init__(self, rngs: list[TensorParallelRNG], *, defaults: bool = True):
        self.rngs = rngs
        self.tracker = get_cuda_rng_tracker()
        self.defaults = defaults
        self.cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def capture(self) -> tuple:
        cpu = torch.get_rng_state() if self.defaults else None
        cuda = torch.cuda.get_rng_state(self.cuda) if self.defaults and self.cuda is not None else None
        # Stream states are replaced, never written in place, by a fork: keeping references is enough.
        return (cpu, cuda, self.tracker.get_states(), [r.local_state for r in self.rngs])

    def restore(self, state: tuple) -> None:
        cpu, cuda, tracked, local = state
        if cpu is not None:
            torch.set_rng_state(cpu)
        if cuda is not None and self.cuda is not None:     # captured only on a CUDA device
            torch.cuda.set_rng_state(cuda, self.cuda)
        self.tracker.set_states(copy.copy(tracked))
        for r, s in zip(self.rngs, local):
            r.local_state = s


def _timed(run: Callable[..., Any], times: list | None, phase: str) -> Callable[..., Any]:
    if times is None:
        return run

    def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return run(*args)
        finally:
            times.append((phase, time.perf_counter() - t0))

    return timed


class _Checkpoint(torch.autograd.Function):
    """function(*inputs) without keeping its activations: forward under no_grad, stored inputs saved for backward
    (so activation meters count them), backward replays the function with the forward's random streams and
    backpropagates through the replay. Gradients flow to tensor inputs and to the parameters the function uses."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], stored: StoredInputs, streams: _RandomStreams,
                *inputs: Any) -> Any:
        ctx.run, ctx.stored, ctx.streams = run, stored, streams
        device = next((t.device for t in inputs if torch.is_tensor(t)), torch.device("cpu"))
        stored.sync(device)
        ctx.random = streams.capture()
        with torch.no_grad():
            outputs = _timed(run, stored.times, "forward")(*inputs)
        kept, ctx.metas, ctx.slots, ctx.others = [], [], [], list(inputs)
        for i, t in enumerate(inputs):
            if torch.is_tensor(t):
                k, meta = stored.keep(t)
                kept.append(k)
                ctx.metas.append((meta, t.requires_grad))
                ctx.slots.append(i)
                ctx.others[i] = None
        ctx.save_for_backward(*kept)
        stored.sync(device)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        inputs = list(ctx.others)
        for i, k, (meta, needs) in zip(ctx.slots, ctx.saved_tensors, ctx.metas):
            inputs[i] = ctx.stored.restore(k, meta).detach().requires_grad_(needs)
        device = next((t.device for t in inputs if torch.is_tensor(t)), torch.device("cpu"))
        ctx.stored.sync(device)
        live = ctx.streams.capture()
        ctx.streams.restore(ctx.random)
        try:
            with torch.enable_grad():
                outputs = _timed(ctx.run, ctx.stored.times, "replay")(*inputs)
        finally:
            ctx.streams.restore(live)
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.stored.sync(device)
        return (None, None, None, *[t.grad if torch.is_tensor(t) and t.requires_grad else None for t in inputs])


def checkpoint_function(function: Callable[..., Any], args: tuple, kwargs: dict, stored: StoredInputs,
                        rngs: list[TensorParallelRNG] | None = None) -> Any:
    """`function(*args, **kwargs)` recomputed in backward, its inputs kept as `stored` says. Keyword arguments
    are passed through (tensors among them are treated as inputs too)."""
    keys = tuple(kwargs)
    flat = tuple(args) + tuple(kwargs[k] for k in keys)
    n = len(args)

    def run(*values: Any) -> Any:
        return function(*values[:n], **dict(zip(keys, values[n:])))

    if not torch.is_grad_enabled():
        return run(*flat)
    return _Checkpoint.apply(run, stored, _RandomStreams(rngs or []), *flat)
