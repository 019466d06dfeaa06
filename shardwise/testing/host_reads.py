"""Counting the host reads (device-to-host copies) shardwise's own code makes: each is a synchronisation point on
a GPU."""

from __future__ import annotations

import os
from typing import Any

import torch


_TESTING = os.path.dirname(os.path.abspath(__file__))
"""This package's own reads (the reference trainer's) are the test's, not shardwise's."""
_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


class HostReadCounter:
    """Counts calls that copy a tensor's value to the host (`.item()`, `.tolist()`, `.cpu()`, `float(t)`,
    `bool(t)`, ...: on a GPU each waits for the device) made by code in `package` (shardwise's own files, not
    torch's or the test's). On the CPU they are cheap, but each is a synchronisation point on a GPU, so the count
    is what the engine would wait for there. Use as a context manager; `calls` lists (method, file:line)."""

    def __init__(self, package: str | None = None):
        import shardwise
        self.package = package or os.path.dirname(os.path.abspath(shardwise.__file__))
        self.calls: list[tuple[str, str]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "HostReadCounter":
        import sys

        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def spy(t: torch.Tensor, *args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                frame = sys._getframe(1)
                where = frame.f_code.co_filename
                if where.startswith(self.package) and not where.startswith(_TESTING):
                    self.calls.append((_name, f"{os.path.relpath(where, self.package)}:{frame.f_lineno}"))
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, name, spy)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}

    def take(self) -> list[tuple[str, str]]:
        """The calls so far; the count starts over."""
        calls, self.calls = self.calls, []
        return calls
