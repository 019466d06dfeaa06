"""Argument types shared by the benchmark modules (argparse errors exit 2 with argparse's one line)."""

from __future__ import annotations

import argparse
from typing import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value
    return parse


def positive_float(what: str = "") -> Callable[[str], float]:
    """`what` names the quantity in the error, e.g. "sizes ... MiB"."""
    def parse(text: str) -> float:
        value = float(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{what + ' ' if what else ''}must be > 0, got {text}")
        return value
    return parse
