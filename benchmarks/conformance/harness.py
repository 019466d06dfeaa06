"""A fix to DeepSpeed's test harness, applied the same under the peer and under shardwise.

Its `DistributedExec._dist_run` runs a distributed test's body in a multiprocessing pool's worker. A failing
assertion there raises pytest's `Failed`, a BaseException, which kills the worker instead of returning the error;
the pool then waits forever for the lost task. Wrapped, the error comes back as an Exception and the test fails
with its message. The wrap must happen in every process (the workers import `unit.common` themselves), so it is
an import hook installed by the conformance sitecustomize.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Sequence

HARNESS_MODULE = "unit.common"


def _wrap(common: types.ModuleType) -> None:
    exec_class = getattr(common, "DistributedExec", None)
    if exec_class is None or getattr(exec_class, "_conformance_wrapped", False):
        return
    original = exec_class._dist_run

    # The pool pickles the bound method by its name: the wrapper must carry the original's.
    @functools.wraps(original)
    def dist_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except Exception:
            raise
        except BaseException as error:  # pytest's Failed and other outcome exceptions, SystemExit
            raise RuntimeError(f"{type(error).__name__}: {error}") from None

    exec_class._dist_run = dist_run
    exec_class._conformance_wrapped = True


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.real.exec_module(module)
        _wrap(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != HARNESS_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if HARNESS_MODULE in sys.modules:
        _wrap(sys.modules[HARNESS_MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
