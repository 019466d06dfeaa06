"""DeepSpeed's `deepspeed.pipe` names (re-exported as `shardwise.pipe`), so a DeepSpeed pipeline script runs by
changing its imports:

    from shardwise.pipe import LayerSpec, PipelineModule
    net = PipelineModule(layers=[LayerSpec(nn.Linear, 32, 32), nn.ReLU(), lambda x: x * 2, ...],
                         loss_fn=nn.CrossEntropyLoss(), num_stages=2, partition_method="parameters")
    engine, _, _, _ = shardwise.initialize(model=net, model_parameters=net.parameters(), config=ds_config,
                                           training_data=dataset)
    for step in range(steps):
        loss = engine.train_batch()
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from shardwise.parallel.pipeline.schedules import PipelineError
from shardwise.parallel.pipeline.stage import PipelineModel
from shardwise.parallel.pipeline.tied import TiedLayer, tied_weight

PARTITIONS = {"parameters": "parameters", "uniform": "uniform", "flops": "flops"}


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 32, 32)`` builds ``nn.Linear(32, 32)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise PipelineError(f"LayerSpec: {typename!r} is not an nn.Module class; give the class and its "
                                f"arguments, e.g. LayerSpec(nn.Linear, 32, 32)")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__}, ...)"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every TiedLayerSpec of the same ``key`` (DeepSpeed's): built once, at
    its first use; a later use may call it through ``forward_fn(module, inputs)``, e.g. the embedding as the
    output projection. Across pipeline stages each stage using it keeps a copy of the weights named by
    ``tied_weight_attr`` (a name or a list; dotted names reach into submodules), made equal at the start and
    after a checkpoint load, their gradients summed over those stages before clipping and the step."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable[[nn.Module, Any], Any]
                 | None = None, tied_weight_attr: str | Sequence[str] = "weight", **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise PipelineError(f"TiedLayerSpec(key={key!r}, ...): the key must be a non-empty string naming the "
                                f"shared module")
        if forward_fn is not None and not callable(forward_fn):
            raise PipelineError(f"TiedLayerSpec({key!r}, forward_fn={forward_fn!r}): give a callable(module, inputs)")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__}, ...)"


class _Call(nn.Module):
    """A plain function as a layer (DeepSpeed accepts callables such as ``lambda x: x.flatten(1)``)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Any) -> Any:
        return self.fn(x)


def _output_is_loss(outputs: Any, labels: Any) -> Any:
    """No loss_fn (DeepSpeed's rule): the last layer's output is the loss itself; the labels are not used."""
    return outputs


class PipelineModule(PipelineModel):
    """DeepSpeed's PipelineModule: layers, a loss function, the number of stages and how to cut them.

    A `PipelineModel` (layers + loss) that also carries DeepSpeed's stage count and partition method:
    `shardwise.initialize` turns them into the config's "pipeline" block (`pipeline_block`). Layers may be
    modules, `LayerSpec`s (built here, in order, optionally each under its own seed as DeepSpeed's
    ``seed_layers``), `TiedLayerSpec`s (one module per key, ``net.tied_modules[key]``) or plain callables such as
    ``lambda x: x.flatten(1)`` (wrapped in a parameterless module). Every rank builds every layer from the same
    seed and then keeps its stage's (DeepSpeed builds only its own): the start is bit-identical to one process.

    Refused with a message that names the fix, rather than half-supported: ``topology=`` (give num_stages, and
    tensor/data parallelism in the config), ``partition_method="type:..."``, ``activation_checkpoint_interval >
    0`` and ``dynamic_shape=True`` (activation shapes are agreed once).
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable[[Any, Any], Any] | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], None] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Any = None, checkpointable_layers: Any = None,
                 dynamic_shape: bool = False) -> None:
        if topology is not None:
            raise PipelineError("PipelineModule(topology=...): give num_stages=, and the tensor / data parallel sizes "
                                "in the config (tensor_parallel.size; data parallelism is what remains)")
        if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int)
                                       or num_stages < 1):
            raise PipelineError(f"PipelineModule(num_stages={num_stages!r}): give a positive number of stages")
        method = str(partition_method).lower()
        if method not in PARTITIONS:
            raise PipelineError(f"PipelineModule(partition_method={partition_method!r}): supported are "
                                f"{', '.join(repr(k) for k in PARTITIONS)}; DeepSpeed's 'type:<regex>' is not (use "
                                f"'parameters')")
        if activation_checkpoint_interval:
            raise PipelineError(f"PipelineModule(activation_checkpoint_interval={activation_checkpoint_interval}): "
                                f"activation recomputation inside pipeline stages is not supported yet; use 0")
        if dynamic_shape:
            raise PipelineError("PipelineModule(dynamic_shape=True): activation shapes are agreed once per run in "
                                "training; use equal micro-batch and sequence sizes and dynamic_shape=False")
        built: list[nn.Module] = []
        tied: dict[str, nn.Module] = {}
        for i, layer in enumerate(layers):
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in tied:
                    if seed_layers:
                        (seed_fn or torch.manual_seed)(base_seed + i)
                    tied[layer.key] = layer.build()
                for attr in layer.tied_weight_attr:
                    tied_weight(tied[layer.key], attr)         # a wrong name fails here, not at the first step
                built.append(TiedLayer(layer.key, tied[layer.key], forward_fn=layer.forward_fn,
                                       weight_attrs=layer.tied_weight_attr))
            elif isinstance(layer, LayerSpec):
                if seed_layers:          # DeepSpeed's seed_layers: each layer built under its own seed
                    (seed_fn or torch.manual_seed)(base_seed + i)
                built.append(layer.build())
            elif isinstance(layer, nn.Module):
                built.append(layer)
            elif callable(layer):
                built.append(_Call(layer))
            else:
                raise PipelineError(f"PipelineModule: layer {i} is a {type(layer).__name__}; give an nn.Module, a "
                                    f"LayerSpec or a callable")
        super().__init__(built, loss_fn if loss_fn is not None else _output_is_loss)
        self.tied_modules = nn.ModuleDict(tied)
        """The modules TiedLayerSpecs share, by key (DeepSpeed's attribute and state-dict names)."""
        self.num_stages = num_stages
        self.partition_method = PARTITIONS[method]

    def pipeline_block(self, config: dict) -> dict:
        """``config`` (a dict) with this module's stages and partition as its "pipeline" block; an explicit block
        must agree on the stage count. DeepSpeed trains pipelines with 1F1B (what its TrainSchedule runs): that is
        the default schedule."""
        if self.num_stages is None:
            return config
        block = dict(config.get("pipeline") or {})
        stages = block.get("stages")
        if stages == "auto":     # DeepSpeed's default: the module's own stage count
            del block["stages"]
            stages = None
        if stages is not None and stages != self.num_stages:
            from shardwise.config import ConfigError
            raise ConfigError(f'"pipeline.stages" is {stages} but the PipelineModule was built with num_stages = '
                              f'{self.num_stages}: make them equal (or leave "pipeline" out of the config)',
                              key="pipeline.stages")
        block.setdefault("stages", self.num_stages)
        block.setdefault("partition", self.partition_method)
        block.setdefault("schedule", "1f1b")
        return {**config, "pipeline": block}
