"""Read a config (path or dict), validate it once, and resolve it into an `EngineConfig`.

Order: read (hjson, as DeepSpeed) -> fill "auto" (`auto.py`) -> sort out unknown top-level keys (`top_level.py`)
-> schema -> batch rule -> not-yet refusals (`unsupported.py`) -> sections (`resolved.py`). Every problem is
reported at once, one per line; what is accepted but ignored becomes one `ConfigWarning` per key.
"""

from __future__ import annotations

import base64
import copy
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import hjson
from pydantic import ValidationError

from shardwise.config.batch import BatchSizes, resolve_batch
from shardwise.config.auto import AutoValues, auto_paths, resolve_auto
from shardwise.config.errors import ConfigError, ConfigProblem, ConfigWarning, problems_from_validation
from shardwise.config.ignored import ignored_settings
from shardwise.config.resolved import EngineConfig, resolve
from shardwise.config.sanity import screen_structure, value_problems
from shardwise.config.schema import ConfigModel
from shardwise.config.top_level import screen_top_level
from shardwise.config.unsupported import refuse_unimplemented

ConfigSource = str | os.PathLike | dict

# Every top-level key the schema validates ("bfloat16" is DeepSpeed's old name of "bf16").
TOP_LEVEL_KEYS = (*ConfigModel.model_fields, "bfloat16")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f'duplicate key "{key}" in the config file (JSON would silently keep the last one)',
                              key=key)
        out[key] = value
    return out


def read_config(config: ConfigSource) -> dict[str, Any]:
    """The config as a fresh plain dict: a dict is deep-copied; a path is read as DeepSpeed reads it, with
    hjson (JSON plus comments, trailing commas and unquoted keys), duplicate keys refused; a string that is
    no file but URL-safe base64 of a config object is decoded, as DeepSpeed does (its launcher passes them).
    Whatever the input (binary, another encoding, absurd nesting or numbers), the outcome is the dict or one
    `ConfigError`."""
    if isinstance(config, dict):
        screen_structure(config, "config")        # before deepcopy, which would recurse
        return copy.deepcopy(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"config must be a path to a JSON file or a dict, got {type(config).__name__}")
    path = os.fspath(config)
    if isinstance(config, str) and not os.path.exists(path):
        inline = _from_base64(config)
        if inline is not None:
            return inline
    try:
        with open(path, "rb") as f:
            text = _decoded(f.read(), path)
    except OSError as e:
        raise ConfigError(f'cannot read config file "{path}": {e.strerror or e}') from None
    data = _parsed(text, f'config file "{path}"')
    if not isinstance(data, dict):
        raise ConfigError(f'config file "{path}" must hold a JSON object {{...}}, got {type(data).__name__}')
    return data


# Byte-order marks of the encodings a UTF-8 reader cannot take. DeepSpeed opens the file as UTF-8 and fails on
# them with a decode error; refusing them (instead of reading them) keeps a config that works here working there.
_OTHER_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
               (b"\xfe\xff", "UTF-16"))


def _decoded(raw: bytes, path: str) -> str:
    for bom, name in _OTHER_BOMS:
        if raw.startswith(bom):
            raise ConfigError(f'config file "{path}" is {name} text (it starts with a {name} byte-order mark); '
                              f'DeepSpeed and shardwise read UTF-8: save it as UTF-8 (e.g. iconv -f {name} -t UTF-8)')
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f'config file "{path}" is not UTF-8 text (byte {e.start} is 0x{raw[e.start]:02x}): '
                          f'is it a binary file? give the JSON config') from None


def _parsed(text: str, source: str) -> Any:
    """hjson's reading of `text`, screened (`sanity.screen_structure`); every failure a `ConfigError`."""
    try:
        data = hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
    except hjson.HjsonDecodeError as e:
        raise ConfigError(f'{source} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}') from None
    except ConfigError as e:
        raise ConfigError(f'{source}: {e}', key=e.key) from None
    except RecursionError:
        raise ConfigError(f'{source} nests objects or lists too deeply to read (a DeepSpeed config nests a few '
                          f'levels): check what wrote it') from None
    except (ValueError, OverflowError) as e:     # a number of more than 4300 digits, or beyond a float (1e999)
        raise ConfigError(f'{source} holds a number out of range ({str(e).split(";")[0]}): give the intended '
                          f'value') from None
    screen_structure(data, source)
    return _plain(data)


def _from_base64(text: str) -> dict[str, Any] | None:
    """The config object encoded in `text`, or None when `text` is not base64 of one (then it is a path)."""
    try:
        decoded = base64.b64decode(text, altchars=b"-_", validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    try:
        data = _parsed(decoded, "the base64 config")
    except ConfigError:
        return None
    return data if isinstance(data, dict) else None


def _plain(value: Any) -> Any:
    """hjson's ordered dicts as plain dicts (what a dict config is, so both compare equal)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _without(data: Any, loc: tuple[Any, ...]) -> None:
    """Remove the key at `loc` (a list element stays: its list fails validation on its own)."""
    for part in loc[:-1]:
        data = data[part]
    if isinstance(data, dict):
        del data[loc[-1]]


@dataclass(frozen=True)
class _Parsed:
    """What parsing found: the model (None when the schema refused the config), the "auto"-filled dict, the
    problems (in document order), the warning lines, and whether a batch key was an unfilled "auto"."""

    model: ConfigModel | None
    config: dict[str, Any]
    problems: list[ConfigProblem]
    warnings: list[str]
    batch_unresolved: bool


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _parse(config: ConfigSource, auto: AutoValues | None) -> _Parsed:
    raw = read_config(config)
    filled = resolve_auto(raw, auto)
    screened = screen_top_level(filled.config, TOP_LEVEL_KEYS)
    problems: list[ConfigProblem] = [*filled.problems, *screened.problems]
    unresolved = auto_paths(screened.config)
    data = copy.deepcopy(screened.config)
    for loc in unresolved:  # validate the rest, so every problem is reported at once
        _without(data, loc)
    model = None
    try:
        model = ConfigModel.model_validate(data)
    except ValidationError as e:
        problems += problems_from_validation(ConfigModel, e, skip=unresolved)
    lines = [*filled.warnings, *screened.warnings, *(ignored_settings(model) if model is not None else [])]
    return _Parsed(model, filled.config, sorted(problems, key=_document_order(raw)), lines,
                   any(loc[0] in _BATCH_KEYS for loc in unresolved))


def _accepted(parsed: _Parsed) -> ConfigModel:
    """The model of a config without problems, its warnings emitted; else the `ConfigError`."""
    if parsed.problems:
        raise ConfigError(parsed.problems)
    assert parsed.model is not None
    for line in parsed.warnings:
        warnings.warn(line, ConfigWarning, stacklevel=4)   # the caller of load_config
    return parsed.model


def parse_config(config: ConfigSource, *, auto: AutoValues | None = None) -> tuple[ConfigModel, dict[str, Any]]:
    """Validate against the schema, "auto" filled from `auto`; returns the model and the filled dict.
    Raises `ConfigError` with every problem; emits a `ConfigWarning` per ignored key of an accepted config."""
    parsed = _parse(config, auto)
    return _accepted(parsed), parsed.config


def _document_order(raw: dict[str, Any]):
    """Sort key putting problems in the order their top-level keys appear in the config."""
    order = {key: i for i, key in enumerate(raw)}

    def key(problem: ConfigProblem) -> int:
        top = (problem.key or "").split(".")[0]
        return order.get(top, len(order))
    return key


def _later_problems(model: ConfigModel, dp_size: int, *, check_batch: bool) -> tuple[BatchSizes | None,
                                                                                       list[ConfigProblem]]:
    """The batch rule and the not-yet refusals: the batch sizes (None if wrong or unchecked) and the problems."""
    problems: list[ConfigProblem] = []
    batch = None
    if check_batch:
        try:
            batch = resolve_batch(train_batch_size=model.train_batch_size,
                                  micro_batch=model.train_micro_batch_size_per_gpu,
                                  grad_accum=model.gradient_accumulation_steps, dp_size=dp_size)
        except ConfigError as e:
            problems += e.problems
    ep = model.expert_parallel.size
    if dp_size % ep:
        problems.append(ConfigProblem("expert_parallel.size", (
            f'"expert_parallel.size" = {ep} does not divide the data-parallel size {dp_size}: the experts are split '
            f'over groups of that many data-parallel ranks; choose a size dividing {dp_size} or change the number of '
            f'processes')))
    return batch, problems + value_problems(model) + refuse_unimplemented(model)


def _load(parsed: _Parsed, dp_size_of: Callable[[ConfigModel], int]) -> EngineConfig:
    """Every problem of the config at once: parsing's, then (when the schema accepted it) the batch rule's,
    unless a batch key is an unfilled "auto" already reported, and the refusals."""
    problems = list(parsed.problems)
    batch = None
    if parsed.model is not None:
        try:
            dp_size = dp_size_of(parsed.model)
        except ConfigError as e:      # no data-parallel size: no batch rule either
            dp_size, problems = None, problems + list(e.problems)
        if dp_size is not None:
            batch, later = _later_problems(parsed.model, dp_size, check_batch=not parsed.batch_unresolved)
            problems += later
        parsed = _Parsed(parsed.model, parsed.config, problems, parsed.warnings, parsed.batch_unresolved)
    model = _accepted(parsed)
    assert batch is not None
    return resolve(model, batch, parsed.config)


def load_config(config: ConfigSource, *, dp_size: int, auto: AutoValues | None = None) -> EngineConfig:
    """Validate a DeepSpeed-style config (JSON path or dict) and resolve it for `dp_size`
    data-parallel ranks, "auto" filled from `auto`. Raises `ConfigError` listing every problem found, one
    per line."""
    return _load(_parse(config, auto), lambda model: dp_size)


def load_config_for_world(config: ConfigSource, *, world_size: int, auto: AutoValues | None = None) -> EngineConfig:
    """As `load_config`, with the data-parallel size derived from the total number of ranks:
    dp = world_size / (tensor_parallel.size * pipeline.stages * context_parallel.size), which must divide
    exactly."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")

    def dp_size_of(model: ConfigModel) -> int:
        tp, pp, cp = model.tensor_parallel.size, model.pipeline.stages, model.context_parallel.size
        if world_size % (tp * pp * cp):
            key = "context_parallel.size" if world_size % (tp * pp) == 0 else "tensor_parallel.size"
            context = f" * context_parallel.size {cp}" if cp > 1 else ""
            raise ConfigError(f"world size {world_size} is not a multiple of tensor_parallel.size {tp} * "
                              f"pipeline.stages {pp}{context} = {tp * pp * cp}; change the number of processes or the "
                              f"parallel sizes", key=key)
        return world_size // (tp * pp * cp)
    return _load(_parse(config, auto), dp_size_of)
