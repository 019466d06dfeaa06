"""DeepSpeed's `zero.Init` (`shardwise.zero.Init`): models constructed inside the block are built as ZeRO-3 shards
(`construction.py`), so no rank ever holds a whole model; ``Init(module=model)`` shards a model built already.
`shardwise.initialize` under zero_optimization.stage 3 then takes the shards as they are."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm.collectives import Comm
from shardwise.comm.dist_api import init_distributed
from shardwise.comm.ledger import CommLedger
from shardwise.config import ZeroConfig
from shardwise.errors import UserError
from shardwise.parallel.zero.construction import ConstructionSharder, partition_constructed
from shardwise.parallel.zero.flat import FlatKey
from shardwise.parallel.zero.gathered import StandaloneGatherer, record_locations
from shardwise.parallel.zero.materialize import materialize_sharded
from shardwise.parallel.zero.params import PARTITION_ATTR, Partition, shard_model


class Init:
    """DeepSpeed's `zero.Init`. As a context manager it builds every model constructed in the block as ZeRO-3
    shards (`construction.py`): each module's parameters are cut to this rank's piece once the module is complete
    (registered as another module's child; the model itself at the end of the block), after its constructor
    initialized them; a parent's later initialization of a child's parameters (an `init_weights()`, transformers'
    `post_init()` and `tie_weights()`) gathers them for the duration. So the values are exactly those the same
    constructors give outside the block under the same seed (rank 0's where ranks' seeds differ), and a rank holds
    its shards plus one module's parameters at a time (plus one unit's new shard while the units are laid out).
    transformers' `from_config`, `from_pretrained` (its weights are sharded as they are loaded) and direct
    constructors work as they are. At the end of the block each model is laid out as ZeRO-3 units;
    `shardwise.initialize` under zero_optimization.stage 3 takes it as it is. A block opened inside another joins
    it. A parameter still on the meta device at the end of the block (a model built under `torch.device("meta")`
    and never given values) is refused: build such a model whole and pass it as ``module=``.
    ``module=`` shards a model built already (rank 0's parameters broadcast, then cut one module at a time).

    ``init=`` (ours, not DeepSpeed's): a callable run on each model at the end of the block, before it is laid out;
    the parameters it touches are gathered as above. Every rank must build the same model and touch the same
    parameters in the same order (the gathers are collectives).

    Every parameter is sharded, small ones too: outside `GatheredParameters` each is a 0-sized placeholder (and
    its `ds_status` NOT_AVAILABLE), as DeepSpeed's zero.Init leaves them; `initialize` then keeps those under the
    config's stage3_*_persistence_threshold values whole on every rank. As in DeepSpeed, the config's
    offload_param block overrides ``remote_device`` / ``pin_memory``.
    ``mpu`` serves the config's batch arithmetic only (DeepSpeed's use); the group defaults to the world, which
    is the data-parallel group without tensor or pipeline parallelism (with them, let `initialize` shard).
    ``remote_device="cpu"`` keeps the shards in host memory (pinned with ``pin_memory`` where CUDA exists) until
    `initialize` places them as the config says; ``dtype`` casts floating-point weights as they are sharded;
    ``mem_efficient_linear`` changes nothing here (ZeRO-3 gathers a weight again for backward anyway). What is
    not built is refused in one line: NVMe (``remote_device="nvme"``, ``param_swapper``), hpZ
    (``zero_param_parallel_group``), quantized weights."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None, *,
                 init: Callable[[nn.Module], None] | None = None):
        _refuse_unbuilt(remote_device=remote_device, zero_param_parallel_group=zero_param_parallel_group,
                        zero_quantized_weights=zero_quantized_weights, param_swapper=param_swapper,
                        zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights)
        if sequence_data_parallel_group is not None and data_parallel_group is not None:
            raise UserError("zero.Init: give data_parallel_group or (deprecated) sequence_data_parallel_group, not "
                            "both")
        if mpu is not None and not callable(getattr(mpu, "get_data_parallel_world_size", None)):
            raise UserError(f"zero.Init(mpu={type(mpu).__name__}): the mpu needs get_data_parallel_world_size() "
                            f"(and get_model_parallel_world_size()), as DeepSpeed's does")
        self.group = data_parallel_group if data_parallel_group is not None else sequence_data_parallel_group
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        self.enabled = enabled
        self.init = init
        self.dtype = dtype
        self.mpu = mpu
        self.remote_device, self.pin_memory = remote_device, pin_memory
        self._sharder: ConstructionSharder | None = None
        self._zero: ZeroConfig | None = None
        self._comm: Comm | None = None
        if module is not None and enabled:
            self._shard_module(module)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        if any(block is self for block in _OPEN):
            raise UserError("zero.Init: this Init is already entered; use a new zero.Init() for each block")
        if _OPEN:                       # inside another block: that one shards what is built here (DeepSpeed's rule)
            _OPEN.append(self)
            return self
        init_distributed()                            # DeepSpeed's Init joins the job too: shards need ranks
        # a persistence threshold still "auto" (it scales with the hidden size) is known once the model is: until
        # then every parameter is sharded, and small ones are made whole again at the end
        deferred = self._has_hidden_size_autos()
        self._zero = None if deferred else self._zero_section()
        self._comm = Comm(self.group, CommLedger(), name="dp:init")
        # every parameter is cut, small ones too (see __exit__)
        self._sharder = ConstructionSharder(self._comm, device=_compute_device(), dtype=self.dtype,
                                            keep_whole_numel=0)
        self._sharder.start()
        _OPEN.append(self)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled:
            return
        _OPEN.remove(self)
        sharder, comm = self._sharder, self._comm
        if sharder is None:             # a block inside another: nothing of its own
            return
        assert comm is not None         # entered: __enter__ set it with the sharder
        self._sharder = None
        try:
            if exc_type is None and self.init is not None:
                for model in sharder.models():
                    self.init(model)
        except BaseException:
            sharder.stop(failed=True)
            raise
        roots = sharder.stop(failed=exc_type is not None)
        if exc_type is not None:
            return
        for model in roots:
            if hasattr(model, PARTITION_ATTR):
                continue
            zero = self._zero if self._zero is not None else self._zero_section(model)
            partition = partition_constructed(model, sharder, persistence_threshold=0, model_persistence_threshold=0)
            _defer_persistence(model, partition)
            self._place(model, zero, comm)

    def _materialize(self, model: nn.Module) -> None:
        zero = self._zero_section(model)
        comm = Comm(self.group, CommLedger(), name="dp:init")
        if self.dtype is not None:
            model.to(self.dtype)                      # on the meta device: only the recorded dtypes change
        materialize_sharded(model, comm=comm, init=self._init_for(model), device=_compute_device(),
                            persistence_threshold=0, model_persistence_threshold=0)
        _defer_persistence(model, getattr(model, PARTITION_ATTR))
        self._place(model, zero, comm)

    def _shard_module(self, module: nn.Module) -> None:
        """DeepSpeed's ``Init(module=model)``: a model built whole on every rank becomes rank 0's weights, cut to
        this rank's shards (a model built on the meta device is materialized instead; one sharded already is
        left as it is)."""
        init_distributed()
        if hasattr(module, PARTITION_ATTR):
            return
        if any(p.device.type == "meta" for p in module.parameters()):
            self._materialize(module)
            return
        zero = self._zero_section(module)
        comm = Comm(self.group, CommLedger(), name="dp:init")
        if self.dtype is not None:
            module.to(self.dtype)
        _broadcast_by_module(module, comm)
        partition = shard_model(module, key_of=lambda p: FlatKey(0 if p.requires_grad else None, p.dtype),
                                dp_size=comm.size, dp_rank=comm.rank, device=_compute_device(), grad_shards=False,
                                persistence_threshold=0, model_persistence_threshold=0)
        module.to(_compute_device())                  # the buffers
        _defer_persistence(module, partition)
        self._place(module, zero, comm)

    def _place(self, model: nn.Module, zero: ZeroConfig, comm: Comm) -> None:
        """Record each parameter's location (for GatheredParameters); shards wait in host memory with remote_device
        "cpu" (the config's offload_param block decides instead when it has one, as in DeepSpeed)."""
        remote, pin = self.remote_device, self.pin_memory
        if zero.offload_param is not None:
            remote, pin = zero.offload_param.device.value, zero.offload_param.pin_memory
        partition = getattr(model, PARTITION_ATTR)
        if remote == "cpu":
            for f in partition.flats:
                f.offload(torch.device("cpu"), pin_memory=pin)
        record_locations(partition, StandaloneGatherer(comm), comm)

    def _init_for(self, model: nn.Module) -> Callable[[nn.Module], None] | None:
        if self.init is not None:
            return self.init
        init_weights = getattr(model, "init_weights", None)
        if callable(init_weights):
            return lambda m: init_weights()           # materialize_sharded calls it with `model` itself
        return None                                   # materialize's default: each module's reset_parameters

    def _zero_section(self, model: nn.Module | None = None) -> ZeroConfig:
        """The config's zero_optimization section. Hugging Face's "auto" placeholders are allowed: only the section
        is read then (the batch sizes, learning rate and scheduler are `initialize`'s to fill), and its hidden-size
        "auto"s (stage3_param_persistence_threshold, ...) are filled from `model` as `initialize` fills them; without
        a model such an "auto" is a `ConfigError` (the caller shards everything until the model is built)."""
        if self.config is None:
            return ZeroConfig()
        from shardwise.config import AutoValues, load_config_for_world, read_config
        from shardwise.config.auto import auto_paths
        # the batch rule's world is every rank (initialize derives dp from it), whatever group shards the model;
        # an mpu gives it as DeepSpeed's config reads it: its data-parallel size times its model-parallel size
        if self.mpu is not None:
            model_parallel = getattr(self.mpu, "get_model_parallel_world_size", lambda: 1)()
            world = self.mpu.get_data_parallel_world_size() * model_parallel
        else:
            world = dist.get_world_size() if dist.is_initialized() else 1
        raw = read_config(self.config)
        if not auto_paths(raw):
            return load_config_for_world(raw, world_size=world).zero
        from shardwise.engine.initialize import hidden_size_of
        section = {k: v for k, v in raw.items() if k in _SHAPING_KEYS}
        section["train_micro_batch_size_per_gpu"] = 1              # a stand-in: no batch rule to satisfy here
        hidden = hidden_size_of(model) if model is not None else None
        return load_config_for_world(section, world_size=world, auto=AutoValues(hidden_size=hidden)).zero

    def _has_hidden_size_autos(self) -> bool:
        """Whether the config's zero section has "auto" values only the model's hidden size fills."""
        if self.config is None:
            return False
        from shardwise.config import read_config
        from shardwise.config.auto import auto_paths
        zero = read_config(self.config).get("zero_optimization")
        return bool(auto_paths(zero)) if isinstance(zero, dict) else False


def _defer_persistence(model: nn.Module, partition: Partition) -> None:
    """Every parameter of a zero.Init model is sharded, small ones too, as DeepSpeed's zero.Init leaves them
    (0-sized outside GatheredParameters); `initialize` makes those under the config's persistence thresholds whole
    (`build._partition`)."""
    partition.persistence_deferred = True
    setattr(model, PARTITION_ATTR, partition)


# What the zero section's validity depends on: itself and the parallel sizes that set the data-parallel size.
_SHAPING_KEYS = ("zero_optimization", "tensor_parallel", "pipeline")


# The zero.Init blocks open now, outermost first. Process-wide, as the registration hooks and torch function modes
# the outermost one installs are: a block opened inside it joins it, as DeepSpeed's nested zero.Init does.
_OPEN: list[Init] = []


def _compute_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _refuse_unbuilt(**given: Any) -> None:
    """One line for an argument asking for what is not built here."""
    if given["remote_device"] not in (None, "none", "cpu"):
        raise UserError(f"zero.Init(remote_device={given['remote_device']!r}): only None (the accelerator) and "
                        f"'cpu' are supported; NVMe offload is not")
    fixes = {"zero_param_parallel_group": "hierarchical partitioning (hpZ) is not supported; leave it None",
             "zero_quantized_weights": "quantized ZeRO-3 weights are not supported; leave it False",
             "zero_quantized_nontrainable_weights": "quantized ZeRO-3 weights are not supported; leave it False",
             "param_swapper": "NVMe parameter swapping is not supported; leave it None"}
    for name, fix in fixes.items():
        if given[name] not in (None, False):
            raise UserError(f"zero.Init({name}=...): {fix}")


@torch.no_grad()
def _broadcast_by_module(model: nn.Module, comm: Comm) -> None:
    """Rank 0's parameters and buffers on every rank, one flat broadcast per module and dtype (a copy of one
    module at a time, not of the model)."""
    if comm.size == 1:
        return
    seen: set[int] = set()
    for m in model.modules():
        own = [t for t in [*m._parameters.values(), *m._buffers.values()] if t is not None and id(t) not in seen]
        seen.update(id(t) for t in own)
        comm.broadcast_coalesced(own)
