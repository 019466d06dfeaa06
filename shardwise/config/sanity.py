"""Configs no run can use, refused before anything is built: a structure no JSON config has
(`screen_structure`) and numbers that make no sense as training settings (`value_problems`). Pure: no torch.
"""

from __future__ import annotations

import math
import re
from typing import Any

from shardwise.config.errors import ConfigError, ConfigProblem, dotted, show

MAX_DEPTH = 64
"""Deepest nesting accepted (DeepSpeed's own configs reach 4: zero_optimization.offload_optimizer.device)."""
INT_LIMIT = 2 ** 63
FLOAT32_MAX = 3.4028234663852886e38
"""Integers must fit int64: counts, sizes and steps do; the torch and C++ code below would overflow. A number
written as a float (DeepSpeed configs write sizes as 5e8) must fit too."""


def _digits(value: int) -> int:
    # str(value) itself raises beyond sys.get_int_max_str_digits(); the bit length gives the count.
    return int(abs(value).bit_length() * math.log10(2)) + 1


def screen_structure(data: Any, source: str) -> None:
    """Refuse, in one line naming the key, a structure no JSON config has. `source` names the config.

    JSON keys are strings, a DeepSpeed config nests a handful of levels, and no setting needs an integer beyond
    int64. Anything else (a 100k-deep list, a 5000-digit number, a dict config with int keys) is one
    `ConfigError` naming where it is, never a RecursionError or a traceback from int-to-str conversion later on.
    The walk is iterative, so it cannot overflow the stack itself."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        where = dotted(path) or "config"
        if len(path) > MAX_DEPTH:
            raise ConfigError(f'{source}: nested more than {MAX_DEPTH} levels deep (at "{dotted(path[:6])}...");'
                              f' a DeepSpeed config nests a few levels: check what wrote the file', key=where)
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ConfigError(f'{source}: key {key!r} in "{where}" is not a string (JSON keys are '
                                      f'strings); write it as "{key}"' if isinstance(key, (int, float))
                                      else f'{source}: key {key!r} in "{where}" is not a string', key=where)
                stack.append((item, path + (key,)))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, path + (i,)) for i, item in enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT <= value < INT_LIMIT:
            raise ConfigError(f'"{where}": an integer of {_digits(value)} digits is out of range (at most '
                              f'2**63 - 1); give the intended value', key=where)
        elif isinstance(value, float) and math.isfinite(value) and abs(value) > FLOAT32_MAX:
            raise ConfigError(f'"{where}": {value:g} is out of range: beyond the largest float32 ({FLOAT32_MAX:g}), '
                              f'the precision training computes in; give the intended value', key=where)
        elif (isinstance(value, float) and math.isfinite(value) and abs(value) >= INT_LIMIT
              and not _real_valued(path)):
            raise ConfigError(f'"{where}": {value:g} is out of range for a size or count (they fit 2**63 - 1); give '
                              f'the intended value', key=where)


# Settings that are real numbers rather than sizes or counts (a huge lr is absurd but representable; a size of
# 1e20 is not). Matched on the key's last name; a list item (betas[0]) goes by its list's name.
_REAL_VALUED = re.compile(r"(^|_)(lr|eps|rate|ratio|decay|momentum|mom|scale|factor|clipping|betas?|gamma|alpha)$")


def _real_valued(path: tuple[Any, ...]) -> bool:
    names = [p for p in path if isinstance(p, str)]
    return bool(names) and _REAL_VALUED.search(names[-1]) is not None


_NON_FINITE_WORDS = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}


def _number(value: Any) -> float | None:
    """The float a setting means (strings like "NaN" and "1e-3" included: the schedulers float() them)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() != "auto":
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _leaves(value: Any, path: tuple[Any, ...]):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, path + (i,))
    else:
        yield path, value


def _rule(name: str) -> tuple[str, Any] | None:
    """(the rule's wording, a check of one number) for a parameter name, or None."""
    if name == "lr" or name.endswith("_lr"):
        return "a learning rate must be >= 0", lambda x: x >= 0
    if name == "eps":
        return "must be > 0 (it keeps the update's denominator away from zero)", lambda x: x > 0
    if name == "betas":
        return "each beta must be in [0, 1)", lambda x: 0 <= x < 1
    if name in ("weight_decay", "momentum", "dampening"):
        return "must be >= 0", lambda x: x >= 0
    return None


def params_problems(params: dict[str, Any], where: str) -> list[ConfigProblem]:
    """The problems of one free-form params block (`where`: "optimizer.params" or "scheduler.params")."""
    problems = []
    betas = params.get("betas")
    if betas is not None and not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        key = f"{where}.betas"
        problems.append(ConfigProblem(key, f'"{key}": {show(betas)}: Adam-style optimizers take two betas '
                                           f'(the gradient\'s and its square\'s decay), e.g. [0.9, 0.999]'))
    for path, leaf in _leaves(params, ()):
        x = _number(leaf)
        if x is None:
            continue
        key = f"{where}.{dotted(path)}"
        if not math.isfinite(x):
            problems.append(ConfigProblem(key, f'"{key}": {show(leaf)} must be a finite number'))
            continue
        rule = _rule(str(path[0]))
        if rule is not None and not rule[1](x):
            problems.append(ConfigProblem(key, f'"{key}": {show(leaf)}: {rule[0]}'))
    return problems


def value_problems(model: Any) -> list[ConfigProblem]:
    """Every nonsensical optimizer/scheduler value of a schema-accepted `ConfigModel`, one problem each: inf/nan
    anywhere in the free-form params (also spelled as strings, "NaN", which the schedulers would float()), a
    negative learning rate, betas outside [0, 1), eps <= 0, a negative weight decay or momentum, and an fp16
    initial_scale_power no float holds. torch checks some of these at construction, but not nan (every
    comparison with nan is false), and never the schedulers' lrs."""
    problems = []
    if model.optimizer is not None:
        problems += params_problems(model.optimizer.params, "optimizer.params")
    if model.scheduler is not None:
        problems += params_problems(model.scheduler.params, "scheduler.params")
    power = model.fp16.initial_scale_power
    if model.fp16.enabled and not -1000 < power < 1000:
        problems.append(ConfigProblem("fp16.initial_scale_power", f'"fp16.initial_scale_power": {power} gives a loss '
                                      f'scale 2**{power} no float holds; DeepSpeed\'s default is 16'))
    return problems
