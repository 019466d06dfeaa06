"""Fixes to the peers' own test harnesses, applied the same under the peer and under shardwise.

DeepSpeed (`unit.common`): `DistributedExec._dist_run` runs a distributed test's body in a multiprocessing pool's
worker. A failing assertion there raises pytest's `Failed`, a BaseException, which kills the worker instead of
returning the error; the pool then waits forever for the lost task. Wrapped, the error comes back as an Exception
and the test fails with its message.

torch (`torch.testing._internal.common_fsdp`): `FSDPTest._run` (the body of each spawned rank) exits with "Need at
least N CUDA devices" whenever the accelerator count is below the world size, so on a CPU-only machine every
multi-process FSDP test is skipped, including those decorated `skip_if_lt_x_gpu(..., allow_cpu=True)` to run on
CPU with gloo. Its sibling `FSDPTestMixin._run` is the same code with the check guarded by `DEVICE_TYPE != "cpu"`;
on CPU the fix runs that one.

Each fix must happen in every process (the ranks import those modules themselves), so each is an import hook
installed by the conformance sitecustomize: the module is patched right after it runs.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable, Sequence


def _fix_deepspeed(common: types.ModuleType) -> None:
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


def _fix_torch_fsdp(common_fsdp: types.ModuleType) -> None:
    test_class = getattr(common_fsdp, "FSDPTest", None)
    mixin = getattr(common_fsdp, "FSDPTestMixin", None)
    if test_class is None or mixin is None or getattr(common_fsdp, "DEVICE_TYPE", None) != "cpu":
        return
    if "_run" not in test_class.__dict__ or "_run" not in mixin.__dict__:
        return
    # The classmethod object itself, so that `cls` stays the test class the rank was spawned for.
    test_class._run = mixin.__dict__["_run"]


FIXES: dict[str, Callable[[types.ModuleType], None]] = {
    "unit.common": _fix_deepspeed,
    "torch.testing._internal.common_fsdp": _fix_torch_fsdp,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader, fix: Callable[[types.ModuleType], None]) -> None:
        self.real, self.fix = real, fix

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.real.exec_module(module)
        self.fix(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        fix = FIXES.get(fullname)
        if fix is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, fix)
        return spec


def install() -> None:
    for name, fix in FIXES.items():
        if name in sys.modules:
            fix(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
