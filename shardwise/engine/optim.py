"""DeepSpeed optimizer and scheduler names -> torch objects, with DeepSpeed's semantics.

    build_optimizer(cfg.optimizer, model.parameters())   # "Adam" -> FusedAdam: torch.optim.AdamW's update,
                                                          # FusedAdam's defaults
    build_scheduler(cfg.scheduler, optimizer)            # DeepSpeed's WarmupLR, ..., then torch's by name

Optimizers follow DeepSpeed 0.19's `DeepSpeedEngine._configure_basic_optimizer` (no offload).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from shardwise.config.errors import ConfigError, ConfigProblem, unknown_name_message
from shardwise.config import OptimizerSpec, SchedulerSpec
from shardwise.engine.lr_schedules import SCHEDULERS
from shardwise.ops.adam import FusedAdam

# DeepSpeed optimizer names that need DeepSpeed's own kernels or extra packages.
DEEPSPEED_ONLY_OPTIMIZERS = {"lamb": "FusedLamb", "lion": "FusedLion", "muadam": "mup.MuAdam",
                             "muadamw": "mup.MuAdamW", "musgd": "mup.MuSGD", "muon": "MuonWithAuxAdam"}
# What DeepSpeed's FusedAdam accepts besides the keys DeepSpeed pops itself.
_FUSED_ADAM_PARAMS = ("lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "set_grad_none")
_ADAM_DEEPSPEED_KEYS = ("adam_w_mode", "torch_adam", "fp32_optimizer_states")
# torch schedulers whose arguments cannot come from JSON or whose step() needs more than nothing.
_TORCH_SCHEDULERS_EXCLUDED = {"LRScheduler", "_LRScheduler", "LambdaLR", "MultiplicativeLR", "SequentialLR",
                              "ChainedScheduler", "ReduceLROnPlateau"}


def torch_optimizers() -> dict[str, type[Optimizer]]:
    """Every optimizer class in torch.optim, by its name."""
    return {name: obj for name, obj in vars(torch.optim).items()
            if inspect.isclass(obj) and issubclass(obj, Optimizer) and obj is not Optimizer}


def torch_schedulers() -> dict[str, type[LRScheduler]]:
    """The torch.optim.lr_scheduler classes that a JSON config can build."""
    return {name: obj for name, obj in vars(torch.optim.lr_scheduler).items()
            if inspect.isclass(obj) and issubclass(obj, LRScheduler) and name not in _TORCH_SCHEDULERS_EXCLUDED}


def _tuples(value: Any) -> Any:
    """JSON lists -> tuples (torch wants betas=(0.9, 0.999))."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _qualified(cls: type) -> str:
    """torch.optim.SGD, torch.optim.lr_scheduler.StepLR, shardwise.engine.lr_schedules.WarmupLR."""
    if cls.__module__.startswith("torch.optim.lr_scheduler"):
        return f"torch.optim.lr_scheduler.{cls.__name__}"
    if cls.__module__.startswith("torch.optim"):
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__name__}"


def _check_names(cls: type[Any], params: dict[str, Any], where: str, skip: int) -> None:
    """Every key of `params` must be a keyword of cls.__init__ (after `skip` leading args), and every
    required keyword must be given; one problem per offence."""
    signature = list(inspect.signature(cls.__init__).parameters.values())[skip:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature):
        return
    accepted = [p.name for p in signature
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    _check_against(params, accepted, where, _qualified(cls))
    missing = [p.name for p in signature if p.default is inspect.Parameter.empty and p.name in accepted
               and p.name not in params]
    if missing:
        raise ConfigError([ConfigProblem(f"{where}.{name}", f'"{where}.{name}" is required by {cls.__name__}')
                           for name in missing])


def _check_against(params: dict[str, Any], accepted: Iterable[str], where: str, owner: str) -> None:
    accepted = list(accepted)
    problems = [ConfigProblem(f"{where}.{key}", unknown_name_message("parameter", key, accepted, shown=f"{where}.{key}")
                              + f" (of {owner})") for key in params if key not in accepted]
    if problems:
        raise ConfigError(problems)


@dataclass(frozen=True)
class OptimizerChoice:
    """What a config's optimizer block becomes: a torch class, its keyword arguments, and why."""

    cls: type[Optimizer]
    kwargs: dict[str, Any]
    note: str = ""
    # what is instantiated when it is not `cls` itself: DeepSpeed's class for "Adam" / "AdamW" (FusedAdam), whose
    # update is `cls`'s bit for bit
    built_as: type[Optimizer] | None = None

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        text = f"{_qualified(self.cls)}({args})"
        return f"{text}  [{self.note}]" if self.note else text


def _flag(params: dict[str, Any], key: str, default: bool) -> bool:
    value = params.pop(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f'"optimizer.params.{key}": {value!r} must be true or false', key=f"optimizer.params.{key}")
    return value


def _adam_family(name: str, params: dict[str, Any]) -> OptimizerChoice:
    """Optimizer types "Adam" / "AdamW" (any case). DeepSpeed builds its FusedAdam with ``adam_w_mode``
    (default true: decoupled weight decay, i.e. AdamW, even for "Adam"; "AdamW" is always decoupled). Here that
    is torch.optim.AdamW (decoupled) or torch.optim.Adam (L2 decay), with FusedAdam's defaults: lr 1e-3, betas
    (0.9, 0.999), eps 1e-8, weight_decay 0 (torch's AdamW default of 0.01 does *not* apply).
    ``"torch_adam": true`` asks DeepSpeed for torch's own class with torch's defaults; so here too.
    ``fp32_optimizer_states`` is dropped (DeepSpeed drops it on this path) and so is ``set_grad_none`` (a
    zero_grad detail). FusedAdam refuses ``amsgrad``; torch has no ``bias_correction: false``.
    """
    adam_w_mode = _flag(params, "adam_w_mode", True)
    torch_adam = _flag(params, "torch_adam", False)
    params.pop("fp32_optimizer_states", None)
    decoupled = name == "adamw" or adam_w_mode
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    decay = "decoupled weight decay" if decoupled else "L2 weight decay added to the gradient"
    if torch_adam:  # DeepSpeed: torch's own class and defaults
        _check_names(cls, params, "optimizer.params", skip=2)
        return OptimizerChoice(cls, params, f"torch_adam=true: torch defaults, {decay}")
    _check_against(params, _FUSED_ADAM_PARAMS + _ADAM_DEEPSPEED_KEYS, "optimizer.params", "DeepSpeed FusedAdam")
    if params.pop("amsgrad", False):
        raise ConfigError('"optimizer.params.amsgrad": true is not supported by DeepSpeed\'s FusedAdam; '
                          'add "torch_adam": true to use torch\'s Adam with AMSGrad', key="optimizer.params.amsgrad")
    if params.pop("bias_correction", True) is not True:
        raise ConfigError('"optimizer.params.bias_correction": only true is supported (torch\'s Adam always '
                          'corrects the moment bias)', key="optimizer.params.bias_correction")
    params.pop("set_grad_none", None)
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **params}
    mode = "AdamW" if name == "adamw" else f"Adam, adam_w_mode={str(adam_w_mode).lower()}"
    return OptimizerChoice(cls, kwargs, f"DeepSpeed {mode}: {decay}; a shardwise.ops.adam.FusedAdam",
                           built_as=FusedAdam)


def resolve_optimizer(spec: OptimizerSpec) -> OptimizerChoice:
    """The torch class and keyword arguments DeepSpeed's semantics give `spec`. Raises `ConfigError`
    for an unknown type or parameter.

    Adam and AdamW as DeepSpeed's FusedAdam (`_adam_family`); any other torch.optim class by name,
    case-insensitively ("SGD", "RMSprop", "Adagrad"), with its own parameters and defaults; DeepSpeed's own
    kernels (Lamb, Lion, MuAdam, MuSGD, Muon, ...) are refused with a clear error."""
    name = spec.type
    params = {key: _tuples(value) for key, value in spec.params.items()}
    if "max_grad_norm" in params:
        raise ConfigError('"optimizer.params.max_grad_norm" is not supported (DeepSpeed rejects it too); use the '
                          'top-level "gradient_clipping" instead', key="optimizer.params.max_grad_norm")
    lowered = name.lower()
    if lowered in ("adam", "adamw"):
        return _adam_family(lowered, params)
    if lowered in DEEPSPEED_ONLY_OPTIMIZERS:
        raise ConfigError(f'"optimizer.type": "{name}" is DeepSpeed\'s {DEEPSPEED_ONLY_OPTIMIZERS[lowered]}, which '
                          f'shardwise does not provide; use "Adam", "AdamW", "SGD" or a torch.optim class',
                          key="optimizer.type")
    available = torch_optimizers()
    by_lower = {n.lower(): cls for n, cls in available.items()}
    if lowered not in by_lower:
        valid = ["Adam", "AdamW", "SGD"] + sorted(n for n in available if n not in ("Adam", "AdamW", "SGD")
                                                  and n.lower() not in DEEPSPEED_ONLY_OPTIMIZERS)
        raise ConfigError(unknown_name_message("optimizer type", name, valid, shown=name), key="optimizer.type")
    cls = by_lower[lowered]
    _check_names(cls, params, "optimizer.params", skip=2)
    return OptimizerChoice(cls, params)


def build_optimizer(spec: OptimizerSpec, params: Iterable[Any]) -> Optimizer:
    """Build the optimizer a config's "optimizer" block names over `params` (tensors or param-group
    dicts). Raises `ConfigError` naming the key for an unknown type, an unknown parameter or a value
    torch rejects."""
    choice = resolve_optimizer(spec)
    params = list(params)
    if not params:
        raise ValueError("build_optimizer got no parameters to optimize")
    try:
        if choice.built_as is FusedAdam:
            # DeepSpeed's class, as DeepSpeed builds for these types (scripts check isinstance(opt, FusedAdam)),
            # with torch's own kernel choice: the update of torch.optim.AdamW (Adam) bit for bit
            return FusedAdam(params, adam_w_mode=choice.cls is torch.optim.AdamW, prefer_fused=False,
                             **choice.kwargs)
        return choice.cls(params, **choice.kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f'"optimizer.params": torch.optim.{choice.cls.__name__} rejected {choice.kwargs}: {e}',
                          key="optimizer.params") from None


def resolve_scheduler(spec: SchedulerSpec) -> tuple[type[LRScheduler], dict[str, Any]]:
    """The scheduler class for `spec.type` (DeepSpeed's names first, `shardwise.engine.lr_schedules`, then the
    torch.optim.lr_scheduler classes, as DeepSpeed falls back to them) and its kwargs."""
    name, params = spec.type, {key: _tuples(value) for key, value in spec.params.items()}
    known: dict[str, type[LRScheduler]] = {**torch_schedulers(), **SCHEDULERS}
    cls = known.get(name) or {n.lower(): c for n, c in known.items()}.get(name.lower())
    if cls is None:
        valid = list(SCHEDULERS) + sorted(n for n in known if n not in SCHEDULERS)
        raise ConfigError(unknown_name_message("scheduler type", name, valid), key="scheduler.type")
    for resume in ("last_batch_iteration", "last_epoch"):
        if resume in params:
            raise ConfigError(f'"scheduler.params.{resume}" is not supported: a schedule resumes from the checkpoint '
                              f'(engine.load_checkpoint); remove it', key=f"scheduler.params.{resume}")
    _check_names(cls, params, "scheduler.params", skip=2)
    return cls, params


def build_scheduler(spec: SchedulerSpec, optimizer: Optimizer) -> LRScheduler:
    """Build the schedule a config's "scheduler" block names, on `optimizer` (step it once per
    optimizer step). Raises `ConfigError` for unknown types/parameters or bad values."""
    cls, params = resolve_scheduler(spec)
    try:
        return cls(optimizer, **params)
    except (TypeError, ValueError) as e:
        raise ConfigError(f'"scheduler.params": {cls.__name__}: {e}', key="scheduler.params") from None


def check_specs(optimizer: OptimizerSpec | None, scheduler: SchedulerSpec | None) -> OptimizerChoice | None:
    """Build both on a throw-away parameter, so that every value torch checks is checked now
    (used by `shardwise check-config`). Returns the optimizer choice, if any."""
    dummy = [torch.nn.Parameter(torch.zeros(1))]
    choice = resolve_optimizer(optimizer) if optimizer is not None else None
    opt = build_optimizer(optimizer, dummy) if optimizer is not None else torch.optim.AdamW(dummy)
    if scheduler is not None:
        build_scheduler(scheduler, opt)
    return choice
