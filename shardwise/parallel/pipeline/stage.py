"""Cut a model into pipeline stages: each rank keeps only its own layers, as V model chunks.

    stage = split_model(model, num_stages=P, stage=pp_rank, virtual_stages=V, partition="parameters")
    release_unowned(model, stage)      # frees the parameters this rank does not hold

This module knows no model: whatever is model-specific comes through `pipeline_layers()` (`PipelineSplittable`).
Layers pass one value along: a tensor or a tuple of tensors (a layer gets it as its one argument).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

from shardwise.config import PipelinePartition
from shardwise.parallel.pipeline.partition import parse_partition_method, partition_layers, stage_layers
from shardwise.parallel.pipeline.schedules import PipelineError
from shardwise.parallel.pipeline.tied import TiedLayer, shared_parameters, tie_stages, tied_modules_of, tied_weight

LossFn = Callable[[Any, Any], Tensor]
"""loss_fn(outputs of the last layer, labels) -> scalar loss of one micro-batch (a mean over its samples)."""


@dataclass
class PipelineLayers:
    """A model seen as a pipeline: what `split_model` cuts (the named layers to partition, modules glued in front
    of the first layer and behind the last one, such as an embedding and a final norm and lm-head, the loss, and a
    sample micro-batch for "flops").

    ``layers`` are partitioned into contiguous model chunks; each is named as in the full model, so a stage's state
    dict keeps the full model's names. ``prefix`` modules run before the first layer and travel with it,
    ``suffix`` modules run after the last layer and travel with it. ``loss_fn(outputs of the last module,
    labels)`` is the loss; ``sample_input`` (one micro-batch of inputs, a sample is enough) is needed only by
    ``"partition": "flops"``, which counts each layer's forward FLOPs on it."""

    layers: list[tuple[str, nn.Module]]
    loss_fn: LossFn
    prefix: list[tuple[str, nn.Module]] = field(default_factory=list)
    suffix: list[tuple[str, nn.Module]] = field(default_factory=list)
    sample_input: Any = None


@runtime_checkable
class PipelineSplittable(Protocol):
    """A model that says how it is cut into pipeline stages."""

    def pipeline_layers(self) -> PipelineLayers:
        """This model as layers: running ``prefix``, ``layers`` and ``suffix`` in order is its forward."""
        ...


class PipelineModel(nn.Module):
    """A model given as a sequence of layers plus a loss function, ready to be split into stages.

    Single-process it is an ordinary model: ``model(inputs)`` runs every layer, ``model(inputs, labels)``
    returns ``loss_fn(outputs, labels)``. ``sample_input`` (one micro-batch of inputs, a sample is enough)
    is only needed for ``"partition": "flops"``, which counts each layer's forward FLOPs on it.
    """

    def __init__(self, layers: Sequence[nn.Module] | nn.Sequential, loss_fn: LossFn, *,
                 sample_input: Any = None) -> None:
        super().__init__()
        if not callable(loss_fn):
            raise PipelineError(f"PipelineModel: loss_fn must be callable(outputs, labels) -> loss, got "
                                f"{type(loss_fn).__name__}")
        self.layers = nn.ModuleList(layers)
        if len(self.layers) == 0:
            raise PipelineError("PipelineModel: layers is empty; give at least one layer per pipeline stage")
        self.loss_fn = loss_fn
        self.sample_input = sample_input

    def forward(self, inputs: Any, labels: Any = None) -> Any:
        x = inputs
        for layer in self.layers:
            x = layer(x)
        return x if labels is None else self.loss_fn(x, labels)

    def pipeline_layers(self) -> PipelineLayers:
        return PipelineLayers([(f"layers.{i}", m) for i, m in enumerate(self.layers)], self.loss_fn,
                              sample_input=self.sample_input)


def _as_layers(model: Any, loss_fn: LossFn | None) -> PipelineLayers:
    """``model`` as a `PipelineLayers`, its loss replaced by ``loss_fn`` when given."""
    if isinstance(model, PipelineSplittable):
        layers = model.pipeline_layers()
        return layers if loss_fn is None else dataclasses.replace(layers, loss_fn=loss_fn)
    if isinstance(model, nn.Sequential) or (isinstance(model, (list, tuple))
                                            and all(isinstance(m, nn.Module) for m in model)):
        named = list(model.named_children()) if isinstance(model, nn.Sequential) else \
            [(str(i), m) for i, m in enumerate(model)]
        if loss_fn is None:
            raise PipelineError(f"a pipelined {type(model).__name__} needs a loss function: pass loss_fn= (or wrap "
                                f"the layers in shardwise.parallel.pipeline.stage.PipelineModel(layers, loss_fn))")
        if not named:
            raise PipelineError("the layer list is empty; give at least one layer per pipeline stage")
        return PipelineLayers(named, loss_fn)
    raise PipelineError(f"cannot split a {type(model).__name__} into pipeline stages: give the built-in GPT (or a "
                        f"model with pipeline_layers(), see shardwise.parallel.pipeline.stage.PipelineLayers), a "
                        f"shardwise.parallel.pipeline.stage.PipelineModel(layers, loss_fn), or an nn.Sequential / list "
                        f"of layers together with loss_fn=")


# ----- partition costs -----

def _param_count(modules: Sequence[nn.Module]) -> int:
    """Parameters of ``modules``; a tied layer counts its module's (as DeepSpeed counts each use)."""
    seen: dict[int, int] = {}
    for m in modules:
        for p in [*m.parameters(), *(m.tied_module.parameters() if isinstance(m, TiedLayer) else ())]:
            seen[id(p)] = p.numel()
    return sum(seen.values())


@contextlib.contextmanager
def _no_side_effects(modules: Sequence[nn.Module]) -> Iterator[None]:
    """No autograd, no RNG draw (dropout would shift the stream the reference run sees), eval mode."""
    modes = [m.training for m in modules]
    devices = [torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_initialized() else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for m in modules:
                m.eval()
            yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


def _flop_counts(layers: PipelineLayers) -> list[int]:
    """Forward FLOPs of each layer on ``sample_input`` (prefix counted in the first, suffix in the last)."""
    from torch.utils.flop_counter import FlopCounterMode
    if layers.sample_input is None:
        raise PipelineError('pipeline.partition = "flops" needs a sample micro-batch to count each layer\'s FLOPs: '
                            'build PipelineModel(layers, loss_fn, sample_input=...) (or pass sample_input= to '
                            'split_model), or use partition "parameters" or "uniform"')
    ordered = [m for _, m in layers.prefix + layers.layers + layers.suffix]
    counts = []
    x = layers.sample_input
    with _no_side_effects(ordered):
        for module in ordered:
            with FlopCounterMode(display=False) as counter:
                x = module(x)
            counts.append(counter.get_total_flops())
    head = len(layers.prefix)
    per_layer = counts[head:head + len(layers.layers)]
    per_layer[0] += sum(counts[:head])
    per_layer[-1] += sum(counts[head + len(layers.layers):])
    return per_layer


def layer_costs(model: Any, method: str | PipelinePartition, *, loss_fn: LossFn | None = None,
                sample_input: Any = None) -> list[float]:
    """The per-layer costs `partition_layers` balances: 1 each ("uniform"), parameter counts ("parameters")
    or forward FLOPs of one sample micro-batch ("flops"); the prefix's and suffix's costs are added to the first
    and last layer."""
    return _costs(_with_sample(_as_layers(model, loss_fn), sample_input), parse_partition_method(method))


def _with_sample(layers: PipelineLayers, sample_input: Any) -> PipelineLayers:
    return layers if sample_input is None else dataclasses.replace(layers, sample_input=sample_input)


def _costs(layers: PipelineLayers, method: PipelinePartition) -> list[float]:
    if method is PipelinePartition.UNIFORM:
        return [1.0] * len(layers.layers)
    if method is PipelinePartition.PARAMETERS:
        costs = [float(_param_count([m])) for _, m in layers.layers]
        costs[0] += _param_count([m for _, m in layers.prefix])
        costs[-1] += _param_count([m for _, m in layers.suffix])
        return costs
    return [float(c) for c in _flop_counts(layers)]


# ----- the stage modules -----

class StageChunk(nn.Module):
    """One model chunk: contiguous layers run in order. ``names[j]`` is layer j's name in the full model."""

    def __init__(self, layers: Sequence[tuple[str, nn.Module]], *, model_chunk: int,
                 blocks: slice | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(m for _, m in layers)
        self.names = [n for n, _ in layers]
        self.model_chunk = model_chunk
        self.blocks = blocks if blocks is not None else slice(0, len(self.layers))
        """The partitioned layers (transformer blocks) among `layers`: not the prefix or suffix glued on."""

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def extra_repr(self) -> str:
        return f"model_chunk={self.model_chunk}, layers={self.names[0]}..{self.names[-1]}"


class PipelineStage(nn.Module):
    """What one pipeline rank holds: its V model chunks (``chunks[v]`` is model chunk v * P + stage)."""

    def __init__(self, chunks: Sequence[StageChunk], *, stage: int, num_stages: int, virtual_stages: int,
                 loss_fn: LossFn, layer_ranges: Sequence[range],
                 tie_stages: dict[str, tuple[int, ...]] | None = None,
                 shared: dict[str, nn.Parameter] | None = None) -> None:
        super().__init__()
        # A ModuleList registers the chunks; typed by what it holds (the checker would see plain Modules).
        self.chunks: Sequence[StageChunk] = nn.ModuleList(chunks)  # type: ignore[assignment]
        self.tied_layers = tied_modules_of([layer for c in chunks for layer in c.layers])
        """key -> a use of each tied module this stage holds (its layers refer to the module, unregistered)."""
        self.tied = nn.ModuleDict({k: t.tied_module for k, t in self.tied_layers.items()})
        self.tie_stages = dict(tie_stages or {})
        """key -> the stages holding a copy of that tied module or shared parameter (all keys of the model)."""
        self.shared = dict(shared or {})
        """Parameters this stage's layers register that other stages' layers register too, by full name."""
        self.stage = stage
        self.num_stages = num_stages
        self.virtual_stages = virtual_stages
        self.loss_fn = loss_fn
        self.layer_ranges = list(layer_ranges)
        """Indices (into the partitioned layers, e.g. GPT blocks) of each local chunk."""

    @property
    def num_model_chunks(self) -> int:
        return self.num_stages * self.virtual_stages

    def model_chunk(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage

    def is_first(self, chunk: int) -> bool:
        """Does local ``chunk`` take the data batch's inputs?"""
        return self.model_chunk(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        """Does local ``chunk`` compute the loss?"""
        return self.model_chunk(chunk) == self.num_model_chunks - 1

    @property
    def reads_data(self) -> bool:
        """Does this stage read the micro-batches (it holds the first or the last model chunk)?"""
        return any(self.is_first(v) or self.is_last(v) for v in range(self.virtual_stages))

    def blocks(self) -> list[nn.Module]:
        """This stage's transformer blocks (the partitioned layers), in forward order over its chunks."""
        return [layer for chunk in self.chunks for layer in chunk.layers[chunk.blocks]]

    def full_names(self) -> dict[str, str]:
        """This module's state-dict keys -> the full model's keys."""
        out = {f"tied.{k}.{key}": f"tied_modules.{k}.{key}" for k, m in self.tied.items()
               for key in m.state_dict(keep_vars=True)}        # DeepSpeed's name for a tied module
        for v, chunk in enumerate(self.chunks):
            for j, (name, layer) in enumerate(zip(chunk.names, chunk.layers)):
                for key in layer.state_dict(keep_vars=True):
                    out[f"chunks.{v}.layers.{j}.{key}"] = f"{name}.{key}"
        return out

    def tied_weights(self) -> dict[str, list[nn.Parameter]]:
        """key -> this stage's copies of the weights tied across stages (a tied module's `tied_weight_attr`s)."""
        out = {k: [tied_weight(t.tied_module, a) for a in t.weight_attrs] for k, t in self.tied_layers.items()}
        return out | {k: [p] for k, p in self.shared.items()}

    def module_names(self) -> dict[str, str]:
        """Each layer's module name here -> its name in the full model ("chunks.0.layers.1" -> "blocks.0")."""
        return {f"chunks.{v}.layers.{j}": name for v, chunk in enumerate(self.chunks)
                for j, name in enumerate(chunk.names)}

    def full_state_dict(self) -> dict[str, Tensor]:
        """This stage's parameters and buffers under the full model's names (gather all stages' to rebuild it)."""
        names = self.full_names()
        return {names[k]: t for k, t in self.state_dict().items()}

    def describe(self) -> str:
        parts = [f"chunk {v} (model chunk {self.model_chunk(v)}): {c.names[0]}..{c.names[-1]}"
                 for v, c in enumerate(self.chunks)]
        return f"stage {self.stage}/{self.num_stages}: " + "; ".join(parts)


def split_model(model: Any, *, num_stages: int, stage: int, virtual_stages: int = 1,
                partition: str | PipelinePartition = PipelinePartition.UNIFORM, loss_fn: LossFn | None = None,
                sample_input: Any = None) -> PipelineStage:
    """The `PipelineStage` of ``stage``: its chunks of ``model``, which is one of

    - a model that describes itself with `pipeline_layers()` (the `PipelineSplittable` protocol): the built-in
      GPT does, beside its own code, and so does `PipelineModel(layers, loss_fn)` (DeepSpeed's PipelineModule
      without the built-in partitioning; `shardwise.pipe.PipelineModule` is one);
    - an ``nn.Sequential`` or a list of layers, with ``loss_fn=`` given.

    The layers are cut into P * V contiguous model chunks with `partition_layers` (costs: one per layer for
    "uniform", parameter counts for "parameters", forward FLOPs of one sample for "flops"; the glued modules'
    costs count with the first and last layer, since they always travel with them); the stage's V chunks come
    in local order (local chunk v = model chunk v * P + stage). The chunks hold the very modules of the full
    model, so a run that builds the full model from one seed on every rank starts bit-identical to the
    single-process model; `release_unowned` then frees the parameters this rank does not hold.

    Raises `PipelineError` for more stages (or chunks) than layers, virtual stages that do not divide the
    layers under "uniform", and unsplittable models.
    """
    layers = _with_sample(_as_layers(model, loss_fn), sample_input)
    if not 0 <= stage < num_stages:
        raise PipelineError(f"stage = {stage} is outside 0..{num_stages - 1} for {num_stages} pipeline stage(s)")
    method = parse_partition_method(partition)
    ranges = partition_layers(_costs(layers, method), num_stages, method, virtual_stages=virtual_stages)
    last = len(ranges) - 1
    every = [(layers.prefix if k == 0 else []) + layers.layers[r.start:r.stop] + (layers.suffix if k == last else [])
             for k, r in enumerate(ranges)]                  # each model chunk's named layers
    chunks, local_ranges = [], stage_layers(ranges, stage=stage, num_stages=num_stages)
    for v, r in enumerate(local_ranges):
        k = v * num_stages + stage
        head = len(layers.prefix) if k == 0 else 0
        chunks.append(StageChunk(every[k], model_chunk=k, blocks=slice(head, head + len(r))))
    # Weights tied across stages: TiedLayer modules by key, and parameters several stages' layers register (a
    # GPT's tied embedding and lm-head) by the full name of their first use.
    shared = shared_parameters(every, num_stages)
    sharing = tie_stages([m for _, m in layers.layers], ranges, num_stages) | {k: s for k, (s, _) in shared.items()}
    return PipelineStage(chunks, stage=stage, num_stages=num_stages, virtual_stages=virtual_stages,
                         loss_fn=layers.loss_fn, layer_ranges=local_ranges, tie_stages=dict(sorted(sharing.items())),
                         shared={k: p for k, (s, p) in shared.items() if stage in s})


@torch.no_grad()
def release_unowned(model: nn.Module, stage: PipelineStage) -> int:
    """Free every parameter and buffer of ``model`` that ``stage`` does not hold (their data becomes an
    empty tensor, so a stray use fails loudly). Returns the bytes released."""
    owned = {id(t) for t in list(stage.parameters()) + list(stage.buffers())}
    released = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in owned and t.numel() > 0:
            released += t.numel() * t.element_size()
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return released
