"""How a Hugging Face decoder model runs under context parallelism, through transformers' own attention interface:
nothing of the model is edited, so its weights and checkpoints are as without cp.

    check_hf_model_for_context_parallel(model, section)   # before any rank starts work: one line if it cannot
    apply_hf_context_parallel(model, cp) -> BatchPart      # after the mesh: attention, loss, and the batch split

Three things change on the instance:
- attention: our function is registered with `AttentionInterface` under a name of its own and the model's config
  names it (`config._attn_implementation`), so every attention layer calls it with its q [b, h, s/C, d] and
  unrepeated k, v [b, hkv, s/C, d]; it runs the cp attention (ring or Ulysses), causal over the whole sequence.
  No mask function is registered for that name, so transformers builds no mask: this rank's positions (0 1 6 7 at
  C = 2, S = 8 under ring attention) are not contiguous, and a mask built from them would read as packed sequences.
- loss: `model.loss_function` becomes the mean over the micro-batch's valid tokens on all cp ranks, reading labels
  that were already shifted (transformers shifts inside its loss, which cannot cross a chunk boundary): its
  `shift_labels=` when the batch has them, else `labels`. Given `num_items_in_batch` (the Trainer's count of the
  step's valid tokens), the cp ranks' summed token losses are divided by it instead, as transformers' loss does.
- the batch (`HuggingFaceBatchPart`): an all-ones `attention_mask` (the Trainer's) is dropped, a mask with zeros
  refused; `labels` are shifted on the whole sequence (label t = token t + 1, the last ignored) before the split
  unless the batch brings `shift_labels`, and `position_ids` of this rank's tokens are passed in, which the rotary
  angles read.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.config.schema import ContextParallelConfig
from shardwise.errors import UserError
from shardwise.parallel.context import ContextAttention, ContextParallel, check_context_parallel
from shardwise.parallel.context.loss import TokenMeanLoss

IGNORE_INDEX = -100
_names = itertools.count()          # one registered attention name per installed cp (several engines per process)


def is_hf_decoder(model: nn.Module) -> bool:
    """A transformers model (its class says whether its attention goes through the attention interface)."""
    return hasattr(type(model), "_supports_attention_backend") and \
        hasattr(getattr(model, "config", None), "_attn_implementation")


def check_hf_model_for_context_parallel(model: nn.Module, section: ContextParallelConfig, *, tp: int = 1) -> None:
    """One line when the Hugging Face `model` cannot run under `section` (`tp`: heads per tensor-parallel rank)."""
    config: Any = model.config
    name = type(model).__name__
    if not getattr(type(model), "_supports_attention_backend", False):
        raise UserError(f"context_parallel.size = {section.size}: {name} does not call its attention through "
                        f"transformers' AttentionInterface, so its attention cannot be replaced; use a model that "
                        f"does (Llama, Mistral, Qwen2, ...) or context_parallel.size 1")
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(f"context_parallel.size = {section.size}: {name} is an encoder-decoder model; context "
                        f"parallelism splits causal decoder sequences: use a decoder-only model or size 1")
    if getattr(config, "sliding_window", None) is not None:
        raise UserError(f"context_parallel.size = {section.size}: {name} has sliding_window = "
                        f"{config.sliding_window}, which cp attention does not mask; set it to None or use size 1")
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        raise UserError(f"context_parallel.size = {section.size}: {name} has attention_dropout = {dropout}, which "
                        f"cp attention does not apply; set it to 0 or use context_parallel.size 1")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    check_context_parallel(section, heads=max(heads // tp, 1), kv_heads=max(kv_heads // tp, 1), seq_len=None,
                           attention_dropout=dropout)


def _cp_attention_function(attention: ContextAttention) -> Any:
    """The function transformers' attention layers call: (module, q [b, h, s, d], k, v [b, hkv, s, d], mask,
    dropout, scaling, ...) -> (output [b, s, h, d], no weights)."""

    def cp_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
        if attention_mask is not None:
            raise UserError("context parallelism: the model was given a prepared attention mask; cp attention is "
                            "causal over whole sequences: pass no attention_mask (mark padding with labels -100)")
        if not getattr(module, "is_causal", True):
            raise UserError(f"context parallelism: {type(module).__name__} is not causal; cp attention is")
        if dropout:
            raise UserError(f"context parallelism: attention dropout {dropout} is not applied by cp attention; set "
                            f"the model's attention_dropout to 0")
        if scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-12 * scaling:
            raise UserError(f"context parallelism: {type(module).__name__} scales scores by {scaling}, not "
                            f"1/sqrt(head_dim); cp attention supports the standard scale only")
        for what in ("sliding_window", "softcap", "s_aux"):
            if kwargs.get(what) is not None:
                raise UserError(f"context parallelism: {type(module).__name__} passes {what}, which cp attention "
                                f"does not apply; use a model without it or context_parallel.size 1")
        out = attention(query, key, value, causal=True)            # [b, h, s, d]
        return out.transpose(1, 2).contiguous(), None

    return cp_attention


def _token_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """The sum of the fp32 token cross-entropies whose (already shifted) label is not ignored."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
                           ignore_index=IGNORE_INDEX, reduction="sum")


class _ShiftedLabelsLoss:
    """`model.loss_function` under cp: transformers calls it (logits, labels, vocab_size, **kwargs)."""

    def __init__(self, mean: TokenMeanLoss):
        self.mean = mean

    def __call__(self, logits: Tensor, labels: Tensor, vocab_size: int | None = None,
                 num_items_in_batch: Any = None, shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
        # num_items_in_batch (Trainer): the step's valid tokens, counted on whole sequences; the loss is the cp
        # ranks' summed token losses over it, as transformers' own loss divides its sum by it.
        return self.mean(logits, labels if shift_labels is None else shift_labels, total_count=num_items_in_batch)


def shift_labels(labels: Tensor) -> Tensor:
    """[b, S] labels as transformers takes them (label t = token t) -> aligned with the inputs (label t = token
    t + 1; the last position ignored)."""
    tail = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], tail], dim=1)


def _without_mask(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The batch without its attention_mask (a keyword or the second positional argument) when the mask is all
    ones, as the Trainer's collators pass it: nothing to mask, and cp attention is causal over whole sequences. A
    mask with zeros (padding) is refused; reading it is one host read per micro-batch."""
    positional = "attention_mask" not in kwargs and len(inputs) > 1
    mask = inputs[1] if positional else kwargs.get("attention_mask")
    if mask is None:
        return inputs, kwargs
    if not bool(torch.as_tensor(mask).bool().all()):
        raise UserError("context parallelism: the batch's attention_mask has zeros (padding), which cp attention "
                        "does not mask: pad on the right and mark the padding with labels -100, with an all-ones "
                        "attention_mask or none")
    if positional:
        return (inputs[0], None, *inputs[2:]), kwargs
    return inputs, {k: v for k, v in kwargs.items() if k != "attention_mask"}


class HuggingFaceBatchPart:
    """The step driver's `BatchPart` for a Hugging Face model: labels shifted on the whole sequence, this rank's
    tokens of every sequence tensor (`ContextParallel.local_batch`), and the positions of those tokens."""

    def __init__(self, cp: ContextParallel):
        self.cp = cp

    def local_batch(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        inputs, kwargs = _without_mask(inputs, kwargs)
        if torch.is_tensor(kwargs.get("labels")) and kwargs.get("shift_labels") is None:
            kwargs = {**kwargs, "labels": shift_labels(kwargs["labels"])}     # (`shift_labels=` come shifted)
        inputs, kwargs = self.cp.local_batch(inputs, kwargs)
        if kwargs.get("position_ids") is None:
            tokens = inputs[0] if inputs else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
            if torch.is_tensor(tokens):
                kwargs["position_ids"] = self.cp.layout.positions(tokens.shape[1], tokens.device).unsqueeze(0)
        return inputs, kwargs


def apply_hf_context_parallel(model: nn.Module, cp: ContextParallel) -> HuggingFaceBatchPart:
    """Install `cp` in a Hugging Face model checked by `check_hf_model_for_context_parallel`, in place."""
    from transformers import AttentionInterface
    name = f"shardwise-cp-{cp.section.impl.value}-{next(_names)}"
    AttentionInterface.register(name, _cp_attention_function(cp.attention))
    configs: dict[int, Any] = {id(m.config): m.config for m in model.modules()
               if hasattr(getattr(m, "config", None), "_attn_implementation")}
    for config in configs.values():
        config._attn_implementation = name
    # transformers' models call `self.loss_function`, a property with a setter: this instance's loss from now on.
    setattr(model, "loss_function", _ShiftedLabelsLoss(cp.mean_loss(_token_loss_sum, ignore_index=IGNORE_INDEX)))
    return HuggingFaceBatchPart(cp)
