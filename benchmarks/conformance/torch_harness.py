"""A fix to torch's FSDP test harness, applied the same under the peer and under shardwise.

`torch.testing._internal.common_fsdp.FSDPTest._run` (the body of each spawned rank) exits with "Need at least N
CUDA devices" whenever the accelerator count is below the world size, so on a CPU-only machine every
multi-process FSDP test is skipped, including those decorated `skip_if_lt_x_gpu(..., allow_cpu=True)` to run on
CPU with gloo. Its sibling `FSDPTestMixin._run` is the same code with the check guarded by `DEVICE_TYPE != "cpu"`;
on CPU the fix runs that one. Like `harness.py` it is an import hook, since each spawned rank imports the module
itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Sequence

HARNESS_MODULE = "torch.testing._internal.common_fsdp"


def _fix(common_fsdp: types.ModuleType) -> None:
    test_class = getattr(common_fsdp, "FSDPTest", None)
    mixin = getattr(common_fsdp, "FSDPTestMixin", None)
    if test_class is None or mixin is None or getattr(common_fsdp, "DEVICE_TYPE", None) != "cpu":
        return
    if "_run" not in test_class.__dict__ or "_run" not in mixin.__dict__:
        return
    # The classmethod object itself, so that `cls` stays the test class the rank was spawned for.
    test_class._run = mixin.__dict__["_run"]


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.real.exec_module(module)
        _fix(module)


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
        _fix(sys.modules[HARNESS_MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
