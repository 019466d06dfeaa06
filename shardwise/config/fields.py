"""Pydantic field types shared by the schema: JSON-friendly but not sloppy.

DeepSpeed configs write integers as floats (``"reduce_bucket_size": 5e8``), so an integer field takes
any integral number. It does not take booleans (``true`` is not 1 here) nor strings (``"8"``), which
pydantic's lax mode would quietly coerce, except in the blocks DeepSpeed itself validates with pydantic models
in lax mode (`DeepSpeedSection`): there DeepSpeed accepts ``"stage": "2"`` and ``"overlap_comm": "true"``, and
so does shardwise.
"""

from __future__ import annotations

import math
import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, TypeAdapter, ValidationError, \
    model_validator


def _as_int(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise ValueError("expected an integer, got a number with a fractional part")
    raise ValueError("expected an integer")


def _as_float(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError("expected a finite number")
        return float(value)
    raise ValueError("expected a number")


def _as_bool(value: Any) -> Any:
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


def _as_str(value: Any) -> Any:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


Int = Annotated[int, BeforeValidator(_as_int)]
PositiveInt = Annotated[int, BeforeValidator(_as_int), Field(gt=0)]
NonNegativeInt = Annotated[int, BeforeValidator(_as_int), Field(ge=0)]
Float = Annotated[float, BeforeValidator(_as_float)]
NonNegativeFloat = Annotated[float, BeforeValidator(_as_float), Field(ge=0)]
Bool = Annotated[bool, BeforeValidator(_as_bool)]
Str = Annotated[str, BeforeValidator(_as_str), Strict()]


class Section(BaseModel):
    """Base of every config block: unknown keys are errors, values are not silently re-typed."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=False)


_LAX: dict[type, TypeAdapter[Any]] = {kind: TypeAdapter(kind) for kind in (bool, int, float)}


def _scalar_kind(annotation: Any) -> type | None:
    """bool, int or float when a field holds one of them (or None); else None."""
    if annotation in _LAX:
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        if len(kinds) == 1 and kinds[0] in _LAX:
            return kinds[0]
    return None


def deepspeed_scalar(value: Any, kind: type) -> Any:
    """``value`` as pydantic's lax mode reads a ``kind`` (bool, int or float) field, which is how DeepSpeed's own
    config models read it: "2" and "2.0" -> 2, true -> 1, "true" / "yes" / "on" / 1 -> True, "1e-3" -> 0.001.
    Unchanged when lax mode refuses it too (the strict field then says why)."""
    try:
        return _LAX[kind].validate_python(value)
    except ValidationError:
        return value


def deepspeed_scalars(model: type[BaseModel], data: Any) -> Any:
    """``data`` (a block's dict) with its bool / int / float fields read as DeepSpeed's lax models read them."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, value in data.items():
        field = model.model_fields.get(name)
        kind = _scalar_kind(field.annotation) if field is not None else None
        if kind is not None and value is not None:
            out[name] = deepspeed_scalar(value, kind)
    return out


class DeepSpeedSection(Section):
    """A block DeepSpeed validates with a pydantic model in lax mode ("zero_optimization", "fp16", "bf16",
    "tensor_parallel", the monitors, ...): its numbers and booleans may be written as DeepSpeed accepts them
    (`deepspeed_scalar`). A subclass with a before-validator of its own that reads those values calls
    `deepspeed_scalars` first (subclass validators run before this one)."""

    @model_validator(mode="before")
    @classmethod
    def _read_scalars_as_deepspeed(cls, data: Any) -> Any:
        return deepspeed_scalars(cls, data)
