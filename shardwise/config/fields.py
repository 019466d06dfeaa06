"""Pydantic field types shared by the schema: JSON-friendly but not sloppy.

DeepSpeed configs write integers as floats (``"reduce_bucket_size": 5e8``), so an integer field takes
any integral number. It does not take booleans (``true`` is not 1 here) nor strings (``"8"``), which
pydantic's lax mode would quietly coerce.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict


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
