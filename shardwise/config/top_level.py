"""Top-level keys the schema does not know: a misspelling, a key DeepSpeed has removed, or one it ignores.

DeepSpeed never looks at top-level keys it does not know, so a config may carry anything there (Hugging Face's
"fp8", launcher settings, notes); shardwise accepts those with one warning each.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable

from shardwise.config.errors import ConfigProblem

# How alike (difflib's ratio, case-insensitive) an unknown key must be to a known one to be taken for its
# misspelling. High on purpose: "comms_config" is a different key from "comms_logger", not a typo of it.
MISSPELLING_RATIO = 0.8

# Keys DeepSpeed 0.19 refuses because the feature was removed: the replacement, if any.
REMOVED_KEYS: dict[str, str] = {
    "nebula": "checkpoints are written with torch.save",
    "compression_training": "no replacement",
    "amp": 'use "fp16" or "bf16"',
    "quantize_training": "no replacement",
    "sparse_gradients": "no replacement",
    "eigenvalue": "no replacement",
    "sparse_attention": "no replacement",
    "elasticity": "set train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps directly",
    "graph_harvesting": "no replacement",
    "curriculum_learning": 'use "data_efficiency.data_sampling.curriculum_learning"',
    "progressive_layer_drop": "no replacement",
}


@dataclass(frozen=True)
class Screened:
    """The config with the ignored keys taken out, the problems found, and one warning line per ignored key."""

    config: dict[str, Any]
    problems: tuple[ConfigProblem, ...]
    warnings: tuple[str, ...]


def _misspelling_of(key: str, known: list[str]) -> str | None:
    lowered = key.lower()
    best = max(known, key=lambda k: difflib.SequenceMatcher(None, lowered, k.lower()).ratio())
    return best if difflib.SequenceMatcher(None, lowered, best.lower()).ratio() >= MISSPELLING_RATIO else None


def screen_top_level(raw: dict[str, Any], known: Iterable[str]) -> Screened:
    """Sort the top-level keys of `raw` that are not in `known`: misspellings and removed keys are problems,
    the rest are dropped with a warning. A key very close to a known one is most likely a misspelling that would
    silently drop a setting, so it is an error with a suggestion; a key DeepSpeed 0.19 removed is an error, as in
    DeepSpeed."""
    known = list(known)
    problems: list[ConfigProblem] = []
    warnings: list[str] = []
    kept: dict[str, Any] = {}
    for key, value in raw.items():
        if key in known:
            kept[key] = value
        elif key in REMOVED_KEYS:
            problems.append(ConfigProblem(key, f'"{key}" was removed from DeepSpeed (0.19 refuses it too): '
                                               f'{REMOVED_KEYS[key]}; remove it'))
        elif (guess := _misspelling_of(key, known)) is not None:
            problems.append(ConfigProblem(key, f'unknown key "{key}": did you mean "{guess}"? (DeepSpeed would '
                                               f'ignore it and lose the setting)'))
        else:
            warnings.append(f'unknown key "{key}" ignored (DeepSpeed ignores unknown top-level keys too)')
    return Screened(kept, tuple(problems), tuple(warnings))
