"""The batch-size rule: train_batch_size = micro batch per GPU * gradient accumulation steps * dp size.

Pure arithmetic shared by the engine, the CLI and the planner, following DeepSpeed 0.19
(`DeepSpeedConfig._set_batch_related_parameters` and `_batch_assertion`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.config.errors import ConfigError

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
ACCUM = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """A consistent batch triple for one data-parallel size:
    train_batch_size == micro_batch * grad_accum * dp_size."""

    train_batch_size: int
    micro_batch: int
    grad_accum: int
    dp_size: int
    derived: tuple[str, ...] = field(default=(), compare=False)
    """Config keys that were computed rather than given (for display only)."""

    def arithmetic(self) -> str:
        """E.g. 'train_batch_size 32 = train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 *
        data-parallel size 4'."""
        return (f"{TRAIN} {self.train_batch_size} = {MICRO} {self.micro_batch} * {ACCUM} {self.grad_accum}"
                f" * data-parallel size {self.dp_size}")


def _check_positive(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f'"{name}": {value!r} must be a positive integer', key=name)
    if value <= 0:
        raise ConfigError(f'"{name}": {value} must be a positive integer (> 0)', key=name)


def _multiples_hint(total: int, unit: int) -> str:
    """Nearby valid totals: the multiples of `unit` just below and above `total`."""
    below, above = (total // unit) * unit, (total // unit + 1) * unit
    return f"{below} or {above}" if below > 0 else f"{above}"


def resolve_batch(*, train_batch_size: int | None, micro_batch: int | None, grad_accum: int | None,
                  dp_size: int) -> BatchSizes:
    """Complete the triple from what was given (None = not given), or check that all three agree:

        given                     derived
        train, micro, accum       nothing; the product must match
        train, micro              accum = train // (micro * dp)
        train, accum              micro = train // (accum * dp)
        micro, accum              train = micro * accum * dp
        train                     accum = 1, micro = train // dp
        micro                     accum = 1, train = micro * dp
        accum only, or nothing    error

    Every term must then be positive and the product exact. DeepSpeed's floor divisions pass its check exactly
    when the division is exact, so here an inexact division is reported directly. Raises `ConfigError` naming
    the key, with the arithmetic, when the terms are inconsistent, non-positive, or too few were given.
    """
    t, m, g, d = train_batch_size, micro_batch, grad_accum, dp_size
    _check_positive(TRAIN, t)
    _check_positive(MICRO, m)
    _check_positive(ACCUM, g)
    if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
        raise ConfigError(f"data-parallel size must be a positive integer, got {d!r}")

    if t is not None and m is not None and g is not None:
        if t != m * g * d:
            raise ConfigError(
                f"{TRAIN} {t} != {MICRO} {m} * {ACCUM} {g} * data-parallel size {d} = {m * g * d}; "
                f"change one of them so the product holds, or give only two and let the third be derived",
                key=TRAIN)
        return BatchSizes(t, m, g, d)

    if t is not None and m is not None:
        unit = m * d
        if t % unit:
            raise ConfigError(
                f"{TRAIN} {t} is not a multiple of {MICRO} {m} * data-parallel size {d} = {unit}, so "
                f"{ACCUM} = {t} / {unit} is not a whole number; use {TRAIN} {_multiples_hint(t, unit)}, "
                f"or change {MICRO}", key=TRAIN)
        return BatchSizes(t, m, t // unit, d, derived=(ACCUM,))

    if t is not None and g is not None:
        unit = g * d
        if t % unit:
            raise ConfigError(
                f"{TRAIN} {t} is not a multiple of {ACCUM} {g} * data-parallel size {d} = {unit}, so "
                f"{MICRO} = {t} / {unit} is not a whole number; use {TRAIN} {_multiples_hint(t, unit)}, "
                f"or change {ACCUM}", key=TRAIN)
        return BatchSizes(t, t // unit, g, d, derived=(MICRO,))

    if m is not None and g is not None:
        return BatchSizes(m * g * d, m, g, d, derived=(TRAIN,))

    if t is not None:
        if t % d:
            raise ConfigError(
                f"{TRAIN} {t} is not a multiple of data-parallel size {d} (with {ACCUM} 1), so {MICRO} = "
                f"{t} / {d} is not a whole number; use {TRAIN} {_multiples_hint(t, d)}, or give {MICRO}",
                key=TRAIN)
        return BatchSizes(t, t // d, 1, d, derived=(MICRO, ACCUM))

    if m is not None:
        return BatchSizes(m * d, m, 1, d, derived=(TRAIN, ACCUM))

    only = f" (only {ACCUM} {g} was given)" if g is not None else ""
    raise ConfigError(f"the batch size is undetermined{only}: give {TRAIN} or {MICRO}, or both", key=TRAIN)
