"""Fill Hugging Face's "auto" placeholders the way its DeepSpeed integration fills them (`resolve_auto`).

Hugging Face's Trainer writes "auto" for values it knows better than the config file: the batch sizes, the
learning rate, the ZeRO bucket sizes. Pure: no torch, no I/O.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Literal

from shardwise.config.errors import ConfigProblem, dotted
from shardwise.config.fields import deepspeed_scalar
from shardwise.config.zero import STAGE3_ALIASES

AUTO = "auto"

# Blocks DeepSpeed validates with its pydantic models, which drop "auto" values (their defaults apply).
_DROPPING_BLOCKS = ("zero_optimization", "fp16", "bf16", "bfloat16", "tensorboard", "wandb", "csv_monitor",
                    "comet", "comms_logger", "hybrid_engine", "compile", "weight_quantization", "tensor_parallel")
# Places where "auto" is DeepSpeed's own value, not Hugging Face's placeholder.
_DEEPSPEED_AUTOS = (("data_types", "keep_in_fp32_modules"),)


@dataclass(frozen=True)
class AutoValues:
    """What the caller knows to fill "auto" with; None where it does not know.

    `shardwise.initialize` finds the hidden size on the model (Hugging Face's `config.hidden_size`, our
    GPT's `cfg.d_model`) and the micro-batch on a `training_data` loader; `check-config` takes every one as a
    flag (--hidden-size, --micro-batch, --grad-accum, --lr, --betas, --eps, --weight-decay, --warmup-steps,
    --total-steps, --max-grad-norm, --precision). Pass `auto=AutoValues(...)` to `initialize` to give the rest.
    The names follow the Trainer's arguments they stand for: gradient_clipping is its max_grad_norm."""

    hidden_size: int | None = None
    micro_batch: int | None = None
    gradient_accumulation_steps: int | None = None
    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    warmup_num_steps: int | None = None
    total_num_steps: int | None = None
    gradient_clipping: float | None = None
    """The Trainer's max_grad_norm; None: its default, 1.0."""
    precision: Literal["fp16", "bf16", "fp32"] | None = None
    """"fp16", "bf16" or "fp32"; None: neither fp16 nor bf16 (the Trainer's default)."""

    def __post_init__(self) -> None:
        if self.precision not in (None, "fp16", "bf16", "fp32"):
            raise ValueError(f'AutoValues.precision must be "fp16", "bf16", "fp32" or None, got {self.precision!r}')

    def merged(self, other: "AutoValues") -> "AutoValues":
        """These values, with `other`'s filling the ones not known here."""
        return AutoValues(**{name: getattr(self, name) if getattr(self, name) is not None else getattr(other, name)
                             for name in self.__dataclass_fields__})


@dataclass(frozen=True)
class AutoResolution:
    """The config with every resolvable "auto" filled (or dropped); one problem per "auto" that could not
    be filled, which is left in place; one warning per "auto" dropped for DeepSpeed's default."""

    config: dict[str, Any]
    problems: tuple[ConfigProblem, ...]
    warnings: tuple[str, ...]


def auto_paths(value: Any, loc: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Where "auto" appears in a config, as key paths."""
    if isinstance(value, str) and value == AUTO:
        return [loc]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in auto_paths(v, loc + (k,))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in auto_paths(v, loc + (i,))]
    return []


def _need(what: str, initialize_arg: str, cli_flag: str | None = None) -> str:
    cli = f", {cli_flag} to check-config" if cli_flag else ""
    return (f"needs {what}: pass auto=AutoValues({initialize_arg}=...) to shardwise.initialize{cli}, "
            f"or write the value")


def _rules(known: AutoValues, config: dict[str, Any]) -> dict[tuple[str, ...], Callable[[], Any]]:
    """Key path -> a function giving its value; it returns `_DROP` to leave the key out (derived or default)
    or raises `_Unresolved` with the reason."""
    h = known.hidden_size
    zero = config.get("zero_optimization")
    # DeepSpeed reads the stage in lax mode: "3" is 3
    stage = deepspeed_scalar(zero.get("stage", 0), int) if isinstance(zero, dict) else 0

    def given(value: Any, why: str) -> Callable[[], Any]:
        def fill() -> Any:
            if value is None:
                raise _Unresolved(why)
            return value
        return fill

    def number(key: str) -> bool:
        value = config.get(key)
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    micro_why = (_need("the micro-batch size", "micro_batch", "--micro-batch")
                 + " (a training_data DataLoader's batch_size is used too)")

    def micro_batch() -> Any:
        if known.micro_batch is not None:
            return known.micro_batch
        if number("train_batch_size"):
            return _DROP        # derivable from train_batch_size by the batch rule
        raise _Unresolved(micro_why)

    def train_batch() -> Any:
        # Derived by the batch rule from the micro-batch; when that is "auto" too, its own problem says so.
        if known.micro_batch is not None or number("train_micro_batch_size_per_gpu") \
                or config.get("train_micro_batch_size_per_gpu") == AUTO:
            return _DROP
        raise _Unresolved(micro_why)

    def per_hidden(scale: Callable[[int], int], zero3_only: bool) -> Callable[[], Any]:
        def fill() -> Any:
            if zero3_only and stage != 3:
                return _DROP    # the Trainer leaves it; DeepSpeed drops it and uses its default
            if h is None:
                raise _Unresolved(_need("the model's hidden size", "hidden_size", "--hidden-size")
                                  + " (found on models with config.hidden_size or cfg.d_model)")
            return scale(h)
        return fill

    precision = known.precision
    lr_why = _need("the learning rate", "lr", "--lr")
    return {
        ("train_micro_batch_size_per_gpu",): micro_batch,
        ("gradient_accumulation_steps",): lambda: known.gradient_accumulation_steps or _DROP,
        ("train_batch_size",): train_batch,
        ("gradient_clipping",): lambda: known.gradient_clipping if known.gradient_clipping is not None else 1.0,
        ("optimizer", "params", "lr"): given(known.lr, lr_why),
        ("optimizer", "params", "betas"): lambda: list(known.betas) if known.betas else [0.9, 0.999],
        ("optimizer", "params", "eps"): lambda: known.eps if known.eps is not None else 1e-8,
        ("optimizer", "params", "weight_decay"): lambda: known.weight_decay if known.weight_decay is not None else 0.0,
        ("scheduler", "params", "warmup_min_lr"): lambda: 0,
        ("scheduler", "params", "warmup_max_lr"): given(known.lr, lr_why),
        ("scheduler", "params", "warmup_num_steps"): given(
            known.warmup_num_steps, _need("the number of warmup steps", "warmup_num_steps", "--warmup-steps")),
        ("scheduler", "params", "total_num_steps"): given(
            known.total_num_steps, _need("the number of training steps", "total_num_steps", "--total-steps")),
        ("fp16", "enabled"): lambda: precision == "fp16",
        ("bf16", "enabled"): lambda: precision == "bf16",
        ("bfloat16", "enabled"): lambda: precision == "bf16",
        # DeepSpeed's own "auto": the stages of the PipelineModule (or 1).
        ("pipeline", "stages"): lambda: _DROP,
        ("zero_optimization", "reduce_bucket_size"): per_hidden(lambda n: n * n, zero3_only=False),
        ("zero_optimization", "stage3_prefetch_bucket_size"): per_hidden(lambda n: int(0.9 * n * n), True),
        ("zero_optimization", "stage3_param_persistence_threshold"): per_hidden(lambda n: 10 * n, True),
    }


class _Unresolved(Exception):
    pass


_DROP = object()


def _rule_key(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    if len(loc) == 2 and loc[0] == "zero_optimization" and loc[1] in STAGE3_ALIASES:
        return (loc[0], STAGE3_ALIASES[loc[1]])
    return loc


def _set(config: dict[str, Any], loc: tuple[Any, ...], value: Any) -> None:
    parent: Any = config
    for part in loc[:-1]:
        parent = parent[part]
    if value is _DROP:
        del parent[loc[-1]]
    else:
        parent[loc[-1]] = value


def resolve_auto(raw: dict[str, Any], known: AutoValues | None = None) -> AutoResolution:
    """Fill every "auto" of `raw` that `known` (or a fixed default) settles, by the Trainer's rules
    (h: the model's hidden size):

        train_micro_batch_size_per_gpu   the micro-batch size
        gradient_accumulation_steps      given, else derived by the batch rule (1 when nothing else fixes it)
        train_batch_size                 derived: micro-batch * accumulation * data-parallel size
        gradient_clipping                given (the Trainer's max_grad_norm), else 1.0 (its default)
        optimizer.params.lr              the learning rate; betas, eps, weight_decay: given, else the Trainer's
                                         defaults [0.9, 0.999], 1e-8, 0.0
        scheduler.params                 warmup_min_lr 0, warmup_max_lr = lr, warmup_num_steps, total_num_steps
        fp16.enabled, bf16.enabled       from the precision, else false
        zero_optimization                reduce_bucket_size h*h; at stage 3 stage3_prefetch_bucket_size
                                         int(0.9*h*h) and stage3_param_persistence_threshold 10*h

    Elsewhere, DeepSpeed's own blocks drop an "auto" and use their default, so those are dropped with a warning.
    "pipeline.stages": "auto" is DeepSpeed's own value (the PipelineModule's stages) and is dropped; in
    "data_types.keep_in_fp32_modules" it is DeepSpeed's default and is kept. Anything else left "auto" is a
    problem naming the key and how to give it."""
    known = known or AutoValues()
    config = copy.deepcopy(raw)
    rules = _rules(known, config)
    problems: list[ConfigProblem] = []
    warnings: list[str] = []
    for loc in auto_paths(raw):
        key = dotted(loc)
        if loc in _DEEPSPEED_AUTOS:
            continue
        rule = rules.get(_rule_key(loc))
        if rule is None:
            if loc[0] in _DROPPING_BLOCKS and len(loc) > 1:
                _set(config, loc, _DROP)
                warnings.append(f'"{key}": "auto" dropped, its default applies (DeepSpeed drops "auto" here too)')
            else:
                problems.append(ConfigProblem(key, f'"{key}": "auto" has no value to take: only the Hugging Face '
                                                   f'integration\'s keys are filled; write the value'))
            continue
        try:
            _set(config, loc, rule())
        except _Unresolved as why:
            problems.append(ConfigProblem(key, f'"{key}": "auto" {why}'))
    return AutoResolution(config, tuple(problems), tuple(warnings))
