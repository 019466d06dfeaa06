"""`ConfigError` and the translation of pydantic's errors into one readable line per problem.

Every line names the dotted key, the bad value, the rule and, where we can guess it, the fix::

    unknown key "zero_optimisation": did you mean "zero_optimization"? valid keys: ...
    "zero_optimization.reduce_bucket_size": 0 must be > 0
"""

from __future__ import annotations

import difflib
import inspect
import json
import re
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from shardwise.errors import UserError


@dataclass(frozen=True)
class ConfigProblem:
    """One problem in a config: the dotted key it concerns (None: the config as a whole) and a full
    sentence that already mentions the key."""

    key: str | None
    message: str


class ConfigWarning(UserWarning):
    """Something in a config is accepted but does nothing (DeepSpeed ignores it too, or shardwise has nothing it
    would tune). Emitted with `warnings.warn`, one line each."""


class ConfigError(UserError, ValueError):
    """The config is wrong. ``str(err)`` has one line per problem; ``err.key`` is the first problem's
    dotted key (None when it concerns no single key); ``err.problems`` lists them all."""

    def __init__(self, problems: str | Sequence[ConfigProblem], *, key: str | None = None) -> None:
        if isinstance(problems, str):
            problems = [ConfigProblem(key, problems)]
        if not problems:
            raise ValueError("ConfigError needs at least one problem")
        self.problems: tuple[ConfigProblem, ...] = tuple(problems)
        self.key: str | None = self.problems[0].key
        super().__init__("\n".join(p.message for p in self.problems))

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep .key and .problems across pickling (errors travel back from spawned ranks).
        return (type(self), (list(self.problems),))


def show(value: Any) -> str:
    """A value as the user wrote it in JSON (true, null, "text"), shortened if long."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def dotted(loc: Iterable[Any]) -> str:
    """("zero_optimization", "offload_optimizer", "device") -> "zero_optimization.offload_optimizer.device";
    list indices are shown as [i]."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def suggest(word: str, choices: Iterable[str]) -> str | None:
    """The closest of `choices` to `word` (case-insensitive), if any is close enough."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


def unknown_name_message(what: str, name: str, valid: Sequence[str], *, where: str = "",
                         shown: str | None = None) -> str:
    """'unknown <what> "<shown>": did you mean "y"? valid <what>s[ in "where"]: a, b, c', where y is
    the entry of `valid` closest to `name`; `shown` (default `name`) is how the bad name is printed."""
    guess = suggest(name, valid)
    hint = f' did you mean "{guess}"?' if guess else ""
    scope = f' in "{where}"' if where else ""
    return f'unknown {what} "{shown or name}":{hint} valid {what}s{scope}: {", ".join(valid)}'


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as `Optional[ZeroConfig]`, if any."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def model_at(root: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The model class that validates the object at `loc` (a path of field names), or None if the
    path leaves the typed schema (e.g. into the free-form optimizer params)."""
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _model_in(model.model_fields[part].annotation)
    return model


def _unknown_key(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    key = str(loc[-1])
    where = dotted(loc[:-1])
    path = dotted(loc)
    parent = model_at(root, loc[:-1])
    valid = list(parent.model_fields) if parent is not None else []
    return unknown_name_message("key", key, valid, where=where, shown=path)


def _one_problem(root: type[BaseModel], err: ErrorDetails) -> ConfigProblem:
    loc = tuple(err["loc"])
    path = dotted(loc)
    kind = err["type"]
    value = err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        return ConfigProblem(path, _unknown_key(root, loc))
    if kind == "missing":
        return ConfigProblem(path, f'"{path}" is required')
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return ConfigProblem(path or None, f'"{path or "config"}": expected an object {{...}}, got {show(value)}')
    if kind in ("literal_error", "enum"):
        # A Literal of enum members lists them as <Enum.NAME: 'value'>; the user wrote the value.
        allowed = re.sub(r"<\w+\.\w+: ('[^']*')>", r"\1", str(ctx.get("expected")))
        return ConfigProblem(path, f'"{path}": {show(value)} is not allowed; allowed: {allowed}')
    if kind in ("list_type", "tuple_type"):      # JSON has lists only; frozen sections keep them as tuples
        return ConfigProblem(path, f'"{path}": expected a list [...], got {show(value)}')
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return ConfigProblem(path, f'"{path}": {show(value)} must be {bounds[kind]} {limit}')
    if kind in ("value_error", "assertion_error"):
        text = str(ctx.get("error", err["msg"]))
        if isinstance(value, dict) or not loc:
            # A whole-block rule (model validator): its message names the keys itself, the first
            # quoted one being the key it is about.
            named = re.match(r'(?:give only one of )?"([\w.]+)"', text)
            return ConfigProblem(named.group(1) if named else (path or None), text)
        return ConfigProblem(path, f'"{path}": {show(value)}: {text}')
    return ConfigProblem(path or None, f'"{path or "config"}": {show(value)}: {err["msg"]}')


def problems_from_validation(root: type[BaseModel], exc: ValidationError,
                             skip: Iterable[tuple[Any, ...]] = ()) -> list[ConfigProblem]:
    """One `ConfigProblem` per pydantic error, in document order, leaving out errors at `skip` paths."""
    skipped = set(skip)
    return [_one_problem(root, err) for err in exc.errors(include_url=False) if tuple(err["loc"]) not in skipped]
