"""Parallelize any model with a plan: module-name patterns -> styles (`Style`).

    info = apply_tensor_parallel(model, tp_comm, {
        "blocks.*.attn": "region",               # bring the attention input into the region once
        "blocks.*.attn.q_proj": "colwise", ...   # (q, k, v then share it: one all-reduce backward, not three)
        "blocks.*.attn.o_proj": "rowwise",
        "embed.tok": "vocab",
    })

This module knows no model: a plan comes from the caller, or from the model itself as its `shardwise_tp_plan`
attribute (`own_plan`); the built-in GPT's and Hugging Face models' live beside them (`models/parallelize.py`).
"""

from __future__ import annotations

import difflib
import enum
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor, nn

from shardwise.comm.collectives import Comm
from shardwise.parallel.tensor_parallel.layers import (
    TP_DIM_ATTR, ColumnParallelLinear, RowParallelLinear, TensorParallelError, VocabParallelEmbedding, not_divisible,
)
from shardwise.parallel.tensor_parallel.mappings import (
    SEQ_DIM, copy_to_region, gather_from_sequence, scatter_to_sequence, sum_grad_over_region,
)
from shardwise.parallel.tensor_parallel.sequence_linear import mark_gathered
from shardwise.parallel.tensor_parallel.random import TensorParallelRNG, run_forked


class Style(enum.StrEnum):
    """How a plan treats the module it names, with t the TP size:

    colwise / colwise_sp / colwise_rep   ColumnParallelLinear: output [.., out/t]; input replicated /
                                         sequence shards / output gathered to [.., out]
    rowwise / rowwise_sp / rowwise_rep   RowParallelLinear: input [.., in/t]; output all-reduced /
                                         reduce-scattered to sequence shards / input replicated (split here).
                                         On an nn.Embedding "rowwise" means "vocab" (as DTensor's RowwiseParallel)
    vocab / vocab_sp                     VocabParallelEmbedding; output all-reduced / reduce-scattered
    region / region_sp                   the module's hidden-states input (first positional argument or
                                         `hidden_states=`) enters the TP region once: copy-to-region /
                                         all-gather from sequence shards. colwise layers inside it then
                                         skip their own input communication. The input must feed only
                                         colwise layers of the region: a replicated consumer's gradient
                                         would be summed t times. (So Hugging Face plans, whose modules
                                         we do not know, keep one input all-reduce per colwise layer.)
    sequence_parallel                    the module runs on sequence shards with replicated parameters
                                         (norms): their gradients are summed over the group
    grad_allreduce                       replicated parameters used on rank-local data (HF's
                                         "replicated_with_grad_allreduce"): gradients summed over the group
    sequence_scatter                     the module's replicated output is split into sequence shards
                                         (split forward, all-gather backward)
    """

    COLWISE = "colwise"
    COLWISE_SP = "colwise_sp"
    COLWISE_REP = "colwise_rep"
    ROWWISE = "rowwise"
    ROWWISE_SP = "rowwise_sp"
    ROWWISE_REP = "rowwise_rep"
    VOCAB = "vocab"
    VOCAB_SP = "vocab_sp"
    REGION = "region"
    REGION_SP = "region_sp"
    SEQUENCE_PARALLEL = "sequence_parallel"
    GRAD_ALLREDUCE = "grad_allreduce"
    SEQUENCE_SCATTER = "sequence_scatter"
    LOCAL_RNG = "local_rng"          # the module's random draws (dropout) from this TP rank's own stream


COLWISE_STYLES = frozenset({Style.COLWISE, Style.COLWISE_SP, Style.COLWISE_REP})
ROWWISE_STYLES = frozenset({Style.ROWWISE, Style.ROWWISE_SP, Style.ROWWISE_REP})
VOCAB_STYLES = frozenset({Style.VOCAB, Style.VOCAB_SP})
REGION_STYLES = frozenset({Style.REGION, Style.REGION_SP})
LAYER_STYLES = COLWISE_STYLES | ROWWISE_STYLES | VOCAB_STYLES

Plan = Mapping[str, Any]
"""Module-name patterns -> a `Style`, its string, or one of torch's style objects (`torch_style`)."""

OWN_PLAN_ATTR = "shardwise_tp_plan"
"""The attribute through which any model may supply its own plan (module-name patterns -> styles)."""


def parse_style(value: Any, key: str) -> Style:
    """A plan entry's style: one of ours (a `Style` or its string), or torch's `ColwiseParallel`,
    `RowwiseParallel` or `SequenceParallel` object, read as ours (`torch_style`)."""
    if not isinstance(value, str):
        return torch_style(value, key)
    try:
        return Style(value)
    except ValueError:
        valid = ", ".join(f'"{s}"' for s in Style)
        raise TensorParallelError(f'tensor-parallel plan entry "{key}": unknown style {value!r}; valid styles are '
                                  f'{valid}') from None


def _layout(layouts: Any) -> Any:
    """The one placement of a torch style's input_layouts / output_layouts (a placement or a 1-tuple)."""
    return layouts[0] if isinstance(layouts, tuple) and len(layouts) == 1 else layouts


def torch_style(value: Any, key: str) -> Style:
    """torch's `torch.distributed.tensor.parallel` style objects as our styles, so that a plan written for torch's
    `parallelize_module` (torchtitan's shape) applies shardwise's layers, which take and give plain tensors:
    ColwiseParallel() "colwise" (output_layouts=Replicate(): "colwise_rep"; input_layouts=Shard(1): "colwise_sp"),
    RowwiseParallel() "rowwise" (output_layouts=Shard(1): "rowwise_sp"; input_layouts=Replicate():
    "rowwise_rep"), SequenceParallel() "sequence_parallel". `use_local_output` has no meaning here: outputs are
    always this rank's plain tensors."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    name = type(value).__name__
    if isinstance(value, SequenceParallel):
        return Style.SEQUENCE_PARALLEL
    if isinstance(value, (ColwiseParallel, RowwiseParallel)):
        into, out = _layout(value.input_layouts), _layout(value.output_layouts)
        seq = Shard(1)
        if isinstance(value, ColwiseParallel):
            styles = {(Replicate(), Shard(-1)): Style.COLWISE, (Replicate(), Replicate()): Style.COLWISE_REP,
                      (seq, Shard(-1)): Style.COLWISE_SP}
        else:
            styles = {(Shard(-1), Replicate()): Style.ROWWISE, (Shard(-1), seq): Style.ROWWISE_SP,
                      (Replicate(), Replicate()): Style.ROWWISE_REP}
        if (into, out) in styles:
            return styles[(into, out)]
        raise TensorParallelError(f'tensor-parallel plan entry "{key}": {name}(input_layouts={into}, '
                                  f"output_layouts={out}) has no shardwise layer; give one of "
                                  f"{', '.join(f'{name}(input_layouts={i}, output_layouts={o})' for i, o in styles)}")
    valid = ", ".join(f'"{s}"' for s in Style)
    raise TensorParallelError(f'tensor-parallel plan entry "{key}": {value!r} is not a style shardwise applies; give '
                              f"ColwiseParallel(), RowwiseParallel(), SequenceParallel() or one of {valid}")


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """`*` matches one dotted name component; the rest is literal; the whole name must match ("blocks.*.mlp"
    matches "blocks.3.mlp")."""
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))


def resolve_plan(module_names: Iterable[str], plan: Plan, *, strict: bool = True) -> dict[str, Style]:
    """Module name -> style for every module a pattern matches. With `strict`, a pattern matching no
    module is an error (a typo would otherwise silently leave the layer whole)."""
    names = [n for n in module_names if n]
    compiled = [(key, pattern_regex(key), parse_style(style, key)) for key, style in plan.items()]
    out: dict[str, Style] = {}
    owner: dict[str, str] = {}
    used: set[str] = set()
    for name in names:
        for key, regex, style in compiled:
            if not regex.fullmatch(name):
                continue
            used.add(key)
            if name in out and out[name] is not style:
                raise TensorParallelError(f'module "{name}" is matched by plan entries "{owner[name]}" ("{out[name]}") '
                                          f'and "{key}" ("{style}"); make the patterns name each module once')
            out[name], owner[name] = style, key
    unused = [key for key, _, _ in compiled if key not in used]
    if strict and unused:
        generic = sorted({re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", n) for n in names})
        lines = []
        for key in unused:
            close = difflib.get_close_matches(key, generic, n=1)
            lines.append(f'"{key}"' + (f' (did you mean "{close[0]}"?)' if close else ""))
        raise TensorParallelError(f"tensor-parallel plan entries match no module of the model: {', '.join(lines)}; "
                                  f"fix the names (modules are named as in model.named_modules(), `*` for an index)")
    return out


def own_plan(model: nn.Module) -> Plan | None:
    """The plan `model` carries as `shardwise_tp_plan`, or None when it carries none (or an empty one)."""
    plan = getattr(model, OWN_PLAN_ATTR, None)
    return plan if isinstance(plan, Mapping) and plan else None


@dataclass
class TensorParallelInfo:
    """What `apply_tensor_parallel` did: the style of every module it touched, and for every parameter it
    replaced, the new parameter (keyed by the id of the old one, which the caller may still hold)."""

    tp_size: int
    styles: dict[str, Style] = field(default_factory=dict)
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)
    # The replaced parameters themselves, kept alive while this record lives: a freed object's id could
    # otherwise be reused by a new parameter, and `remap` would then translate it wrongly.
    originals: list[nn.Parameter] = field(default_factory=list, repr=False)

    def remap(self, model_parameters: Iterable[Any]) -> list[Any]:
        """Translate DeepSpeed-style `model_parameters` (tensors or param-group dicts) gathered from the full
        model into the parallelized model's parameters."""
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            return [dict(g, params=[self.replaced.get(id(p), p) for p in g["params"]]) for g in items]
        return [self.replaced.get(id(p), p) for p in items]


def _effective_style(module: nn.Module, style: Style) -> Style:
    """DTensor's RowwiseParallel on an embedding shards the vocabulary: our "vocab"."""
    if isinstance(module, nn.Embedding) and style in (Style.ROWWISE, Style.ROWWISE_SP):
        return Style.VOCAB if style is Style.ROWWISE else Style.VOCAB_SP
    return style


def check_plan(model: nn.Module, styles: Mapping[str, Style], tp: int) -> list[str]:
    """Every problem of applying `styles` at TP size `tp`: wrong module types and sizes not divisible by tp."""
    problems = []
    for name, style in styles.items():
        module = model.get_submodule(name)
        style = _effective_style(module, style)
        where = f'{name} ("{style}")'
        if style in COLWISE_STYLES | ROWWISE_STYLES:
            if not isinstance(module, nn.Linear):
                problems.append(f"{where}: column/row-parallel styles apply to nn.Linear, got "
                                f"{type(module).__name__}")
            elif style in COLWISE_STYLES and module.out_features % tp:
                problems.append(f"{where}: " + not_divisible("out_features", module.out_features, tp,
                                                             "each rank holds out_features / size output features"))
            elif style in ROWWISE_STYLES and module.in_features % tp:
                problems.append(f"{where}: " + not_divisible("in_features", module.in_features, tp,
                                                             "each rank holds in_features / size input features"))
        elif style in VOCAB_STYLES:
            if not isinstance(module, nn.Embedding):
                problems.append(f"{where}: vocab styles apply to nn.Embedding, got {type(module).__name__}")
            elif module.num_embeddings % tp:
                problems.append(f"{where}: " + not_divisible("num_embeddings (vocabulary)", module.num_embeddings,
                                                             tp, "pad the vocabulary to a multiple of the size"))
    return problems


def _in_region(name: str, regions: set[str]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in regions for i in range(1, len(parts)))


def _build_layer(module: nn.Module, style: Style, comm: Comm, in_region: bool) -> nn.Module:
    """The parallel layer for a module `check_plan` accepted (the module types below are its checks)."""
    if style in COLWISE_STYLES and isinstance(module, nn.Linear):
        return ColumnParallelLinear(module, comm, gather_output=style is Style.COLWISE_REP,
                                    sequence_parallel=style is Style.COLWISE_SP, input_in_region=in_region)
    if style in ROWWISE_STYLES and isinstance(module, nn.Linear):
        return RowParallelLinear(module, comm, input_is_parallel=style is not Style.ROWWISE_REP,
                                 sequence_parallel=style is Style.ROWWISE_SP)
    if style in VOCAB_STYLES and isinstance(module, nn.Embedding):
        return VocabParallelEmbedding(module, comm, sequence_parallel=style is Style.VOCAB_SP)
    raise TensorParallelError(f"style {style} does not apply to a {type(module).__name__} (check_plan first)")


class _RegionEntry:
    """Forward pre-hook: map the module's hidden-states input into the TP region once."""

    def __init__(self, comm: Comm, sequence_parallel: bool, name: str):
        self.comm, self.sequence_parallel, self.name = comm, sequence_parallel, name

    def _map(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:     # the region's linears keep this [b, s/t, h] shard, not the gathered input
            return mark_gathered(gather_from_sequence(x, self.comm), x, self.comm, SEQ_DIM)
        return copy_to_region(x, self.comm)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (self._map(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": self._map(kwargs["hidden_states"])}
        raise TensorParallelError(f'"{self.name}" has a region style but was called without a positional input '
                                  f'or hidden_states=; give the style to a module whose first input is the '
                                  f'activations')


class _SequenceScatter:
    """Forward hook: replace the module's replicated [b, s, h] output by this rank's sequence shard."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def __call__(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return scatter_to_sequence(output, self.comm)


def _tied_groups(model: nn.Module) -> dict[int, list[tuple[str, str]]]:
    """id of every Parameter object used in more than one place -> its (module name, parameter name) places."""
    seen: dict[int, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            seen.setdefault(id(p), [])
            if (mod_name, p_name) not in seen[id(p)]:
                seen[id(p)].append((mod_name, p_name))
    return {key: places for key, places in seen.items() if len(places) > 1}


def _retie(model: nn.Module, ties: dict[int, list[tuple[str, str]]], replaced_modules: set[str],
           replaced: dict[int, nn.Parameter]) -> None:
    """Shared parameters (tied embeddings) stay shared when every user was cut along the same dimension;
    `replaced` then maps the old shared parameter to the one kept."""
    for old_id, places in ties.items():
        if not any(m in replaced_modules for m, _ in places):
            continue
        params = [getattr(model.get_submodule(m), p) for m, p in places]
        dims = {getattr(p, TP_DIM_ATTR, None) for p in params}
        shapes = {tuple(p.shape) for p in params}
        where = ", ".join(f"{m}.{p}" for m, p in places)
        if len(dims) != 1 or len(shapes) != 1 or None in dims:
            raise TensorParallelError(f"tied parameters {where} are split differently by the plan; give every module "
                                      f"that shares them the same split (e.g. lm-head \"colwise\" with embedding "
                                      f"\"vocab\")")
        first = params[0]
        for m, p in places[1:]:
            setattr(model.get_submodule(m), p, first)
        replaced[old_id] = first


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def apply_tensor_parallel(model: nn.Module, comm: Comm, plan: Plan, *, strict: bool = True) -> TensorParallelInfo:
    """Split `model` in place over the TP group of `comm` following `plan` (patterns -> `Style`s).

    Linear and Embedding modules named by a layer style are replaced in place by a layer cut from them
    (`layers.py`); the other styles attach hooks. The model keeps its structure and parameter names, so
    `state_dict()` keys are unchanged (tensors are shards).

    Every rank must hold the same full model when this is called. Raises `TensorParallelError` listing every
    problem (unknown style, pattern matching nothing when `strict`, wrong module type, size not divisible
    by the group size) before anything is changed."""
    tp = comm.size
    styles = resolve_plan((n for n, _ in model.named_modules()), plan, strict=strict)
    problems = check_plan(model, styles, tp)
    if problems:
        raise TensorParallelError(f"tensor_parallel.size = {tp} cannot split this model:\n  - "
                                  + "\n  - ".join(problems))
    ties = _tied_groups(model)
    regions = {n for n, s in styles.items() if s in REGION_STYLES}
    # Same default random stream on every TP rank from here on (replicated dropout masks must agree).
    first = next(iter(model.parameters()), None)
    rng = TensorParallelRNG(comm, first.device if first is not None else torch.device("cpu"))
    info = TensorParallelInfo(tp_size=tp, styles=dict(styles))
    replaced_modules: set[str] = set()
    for name, style in styles.items():
        module = model.get_submodule(name)
        style = _effective_style(module, style)
        if style in LAYER_STYLES:
            new = _build_layer(module, style, comm, _in_region(name, regions))
            for p_name, old in module.named_parameters(recurse=False):
                info.replaced[id(old)] = getattr(new, p_name)
                info.originals.append(old)
            _set_submodule(model, name, new)
            replaced_modules.add(name)
        elif style in REGION_STYLES:
            module.register_forward_pre_hook(_RegionEntry(comm, style is Style.REGION_SP, name), with_kwargs=True)
        elif style in (Style.SEQUENCE_PARALLEL, Style.GRAD_ALLREDUCE):
            for p in module.parameters():
                sum_grad_over_region(p, comm)
        elif style is Style.SEQUENCE_SCATTER:
            module.register_forward_hook(_SequenceScatter(comm))
        elif style is Style.LOCAL_RNG:
            run_forked(module, rng)
    _retie(model, ties, replaced_modules, info.replaced)
    return info
