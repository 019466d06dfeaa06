"""Serve a peer's public modules from shardwise, so the peer's own test files run against shardwise.

DeepSpeed: the real package is imported first (its internals keep the references they bound at import), then every
`deepspeed.X.Y` entry in `sys.modules` is replaced by a `SwappedModule`: an attribute is looked up in
`shardwise.X.Y` first and in DeepSpeed's own module second. A test that reaches a name shardwise does not provide
still runs against DeepSpeed's code for that name, and the access is written to a log so that the report can say
which tests exercised shardwise and which leaned on DeepSpeed's internals (`report.classify`).

torch: the wrapper classes (`fully_shard`, `FSDPModule`, `FullyShardedDataParallel`, `DistributedDataParallel`,
the policies) are set on torch's own modules before the test files import them.

The log is one line per first access of a name in a short window: `time  pid  ours|theirs  dotted.name`. Tests run
one after another, so the report attributes each line to the test whose start/end times enclose it, including lines
written by the worker processes a distributed test spawns.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
import types
from typing import Any, Sequence

LOG_ENV = "SHARDWISE_CONFORMANCE_LOG"
PEER = "deepspeed"
OURS = "shardwise"

# Repeated accesses of one name inside this window are logged once: a test's loop calling get_rank() a thousand
# times needs one line, and tests are far longer than this.
_THROTTLE_S = 0.2
_last_logged: dict[tuple[str, str], float] = {}


TESTS_ENV = "SHARDWISE_CONFORMANCE_TESTS"
HARNESS_FILES = ("common.py",)


def _read_by_a_test(depth: int) -> bool:
    """Whether the code reading the name is a test's own: code in a file of the peer's test tree other than its
    harness, and at module level only a test file's own imports (`from deepspeed.runtime.config import
    DeepSpeedConfig`): a shared helper's imports (its model file's) would otherwise be charged to every test.
    Reads by the peer's internals (which call each other through these modules too) and by shardwise say nothing
    about what a test exercises."""
    root = os.environ.get(TESTS_ENV)
    code = sys._getframe(depth + 1).f_code
    basename = os.path.basename(code.co_filename)
    if code.co_name == "<module>" and not basename.startswith("test_"):
        return False
    if root is None:
        return True
    return code.co_filename.startswith(root) and basename not in HARNESS_FILES


def _log(kind: str, name: str) -> None:
    if os.environ.get(LOG_ENV) and _read_by_a_test(2):
        _append(kind, name)


def _append(kind: str, name: str, *, throttle: bool = True) -> None:
    path = os.environ[LOG_ENV]
    now = time.time()
    key = (kind, name)
    if throttle and now - _last_logged.get(key, 0.0) < _THROTTLE_S:
        return
    _last_logged[key] = now
    # O_APPEND writes of one short line are atomic between the processes of one test.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{now:.6f}\t{os.getpid()}\t{kind}\t{name}\n".encode())
    finally:
        os.close(fd)


def _ours_for(peer_name: str) -> types.ModuleType | None:
    """`deepspeed.a.b` -> `shardwise.a.b` when shardwise has that module, else None."""
    ours_name = OURS + peer_name[len(PEER):]
    try:
        return importlib.import_module(ours_name)
    except ImportError:
        return None


# What the import system reads off a module object: never forwarded (a plain module's `__path__` taken from a
# shardwise package would make it a package). Other dunders (`__version__`, `__compatible_ops__`) are forwarded.
_MODULE_MACHINERY = frozenset({"__path__", "__file__", "__spec__", "__loader__", "__package__", "__name__",
                               "__builtins__", "__cached__", "__getattr__", "__dict__"})


class SwappedModule(types.ModuleType):
    """One `deepspeed.*` module: shardwise's attribute when it has one, DeepSpeed's otherwise."""

    def __init__(self, name: str, ours: types.ModuleType | None, theirs: types.ModuleType | None) -> None:
        super().__init__(name)
        self.__dict__["_sw_ours"] = ours
        self.__dict__["_sw_theirs"] = theirs
        # Import machinery reads these to find and name submodules; they must be DeepSpeed's.
        source = theirs if theirs is not None else ours
        for attr in ("__path__", "__file__", "__spec__", "__package__", "__loader__"):
            if source is not None and hasattr(source, attr):
                self.__dict__[attr] = getattr(source, attr)

    def __getattr__(self, attr: str) -> Any:
        if attr in _MODULE_MACHINERY:
            raise AttributeError(attr)
        name = f"{self.__name__}.{attr}"
        ours = self.__dict__["_sw_ours"]
        theirs = self.__dict__["_sw_theirs"]
        if ours is not None:
            try:
                value = getattr(ours, attr)
            except AttributeError:
                pass
            else:
                _log("ours", name)
                return _as_swapped(value)
        if theirs is not None:
            try:
                value = getattr(theirs, attr)
            except AttributeError:
                pass
            else:
                _log("theirs", name)
                return _as_swapped(value)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r} (in shardwise or {PEER})")

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for source in (self.__dict__["_sw_ours"], self.__dict__["_sw_theirs"]):
            if source is not None:
                names.update(dir(source))
        return sorted(names)


def _swapped(name: str, theirs: types.ModuleType | None) -> SwappedModule:
    current = sys.modules.get(name)
    if isinstance(current, SwappedModule):
        return current
    module = SwappedModule(name, _ours_for(name), theirs)
    sys.modules[name] = module
    return module


def _as_swapped(value: Any) -> Any:
    """Modules reached by attribute stay swapped: `deepspeed.runtime.zero` is a SwappedModule too."""
    if isinstance(value, types.ModuleType) and not isinstance(value, SwappedModule):
        name = value.__name__
        if name == PEER or name.startswith(PEER + "."):
            return _swapped(name, value)
        if name == OURS or name.startswith(OURS + "."):
            peer_name = PEER + name[len(OURS):]
            existing = sys.modules.get(peer_name)
            theirs = existing if existing is not None and not isinstance(existing, SwappedModule) else None
            if isinstance(existing, SwappedModule):
                return existing
            return _swapped(peer_name, theirs)
    return value


class _SwapLoader(importlib.abc.Loader):
    """Runs DeepSpeed's module, then leaves its swapped view in sys.modules (the import returns that)."""

    def __init__(self, real: importlib.machinery.ModuleSpec) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        assert self.real.loader is not None
        return self.real.loader.create_module(self.real)

    def exec_module(self, module: types.ModuleType) -> None:
        assert self.real.loader is not None
        self.real.loader.exec_module(module)
        sys.modules[module.__name__] = SwappedModule(module.__name__, _ours_for(module.__name__), module)


class _SwapFinder(importlib.abc.MetaPathFinder):
    """A `deepspeed.*` module imported after the swap is loaded from DeepSpeed and swapped the same way."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PEER + "."):
            return None
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if real is None or real.loader is None:
            return None
        spec = importlib.util.spec_from_loader(fullname, _SwapLoader(real), origin=real.origin,
                                               is_package=real.submodule_search_locations is not None)
        assert spec is not None
        if real.submodule_search_locations is not None:
            spec.submodule_search_locations = list(real.submodule_search_locations)
        spec.has_location = real.has_location
        return spec


def install_deepspeed() -> None:
    import deepspeed  # noqa: F401  the real package, with every internal module it imports

    for name in [n for n in list(sys.modules) if n == PEER or n.startswith(PEER + ".")]:
        module = sys.modules[name]
        if module is not None and not isinstance(module, SwappedModule):
            sys.modules[name] = SwappedModule(name, _ours_for(name), module)
    # Parents hold their children as attributes: point those at the swapped children.
    for name, module in list(sys.modules.items()):
        if isinstance(module, SwappedModule) and "." in name:
            parent, child = name.rsplit(".", 1)
            parent_module = sys.modules.get(parent)
            if isinstance(parent_module, SwappedModule):
                parent_module.__dict__[child] = module
    sys.meta_path.insert(0, _SwapFinder())


# torch's names and where shardwise keeps the same thing.
TORCH_SWAPS: dict[str, list[tuple[str, str]]] = {
    "torch.distributed.fsdp": [
        ("fully_shard", "fully_shard"), ("FSDPModule", "FSDPModule"),
        ("MixedPrecisionPolicy", "MixedPrecisionPolicy"), ("CPUOffloadPolicy", "CPUOffloadPolicy"),
        ("OffloadPolicy", "OffloadPolicy"), ("FullyShardedDataParallel", "FullyShardedDataParallel"),
        ("MixedPrecision", "MixedPrecision"), ("CPUOffload", "CPUOffload"),
    ],
    "torch.distributed._composable.fsdp": [
        ("fully_shard", "fully_shard"), ("FSDPModule", "FSDPModule"),
        ("MixedPrecisionPolicy", "MixedPrecisionPolicy"), ("CPUOffloadPolicy", "CPUOffloadPolicy"),
        ("OffloadPolicy", "OffloadPolicy"),
    ],
    "torch.distributed.fsdp.fully_sharded_data_parallel": [
        ("FullyShardedDataParallel", "FullyShardedDataParallel"),
    ],
    "torch.nn.parallel": [("DistributedDataParallel", "DistributedDataParallel")],
    "torch.nn.parallel.distributed": [("DistributedDataParallel", "DistributedDataParallel")],
    "torch.distributed.checkpoint.state_dict": [("get_state_dict", "get_state_dict"),
                                                ("set_state_dict", "set_state_dict")],
}


# Peer modules that bind a swapped name at import for their own use, and must keep torch's: the composable
# `replicate` (torch's tests' DDP reference model) wraps `torch.nn.parallel.DistributedDataParallel`.
TORCH_KEEP_OWN = ("torch.distributed._composable.replicate",)

# Test-harness modules imported after the swap (their model helpers call `fully_shard` / `FSDP`, the subject),
# with names that must stay torch's restored: common_fsdp's `DDP` is the reference FSDP1 tests compare against.
TORCH_HARNESS_RESTORE: dict[str, list[tuple[str, str, str]]] = {
    "torch.testing._internal.common_fsdp": [("DDP", "torch.nn.parallel.distributed", "DistributedDataParallel")],
}


def _log_torch_call(name: str) -> None:
    """torch: a call of a swapped wrapper, whoever makes it (the test, or torch's harness helpers and
    `distributed_test.py`, which live in the wheel), is shardwise exercised by the running test. Not throttled:
    tests a tenth of a second long follow each other, and wrappers are built a few times per test."""
    if os.environ.get(LOG_ENV):
        _append("ours", name, throttle=False)


def _calls_logged(name: str, value: Any) -> Any:
    """`value` (a shardwise function or class set on a torch module) logging each call / construction. A class
    keeps its identity (isinstance checks): its own `__init__` is wrapped, in this conformance process only."""
    if isinstance(value, type):
        init = value.__dict__.get("__init__")
        if init is None or getattr(init, "_conformance_logged", False):
            return value

        @functools.wraps(init)
        def logged_init(self: Any, *args: Any, **kwargs: Any) -> None:
            _log_torch_call(name)
            init(self, *args, **kwargs)

        setattr(logged_init, "_conformance_logged", True)
        setattr(value, "__init__", logged_init)
        return value
    if callable(value):
        @functools.wraps(value)
        def logged(*args: Any, **kwargs: Any) -> Any:
            _log_torch_call(name)
            return value(*args, **kwargs)
        return logged
    return value


def install_torch() -> None:
    import shardwise

    for module_name in TORCH_KEEP_OWN:
        importlib.import_module(module_name)
    originals: dict[tuple[str, str], Any] = {}
    logged: dict[str, Any] = {}             # one logging wrapper per shardwise name, set on every torch module
    for module_name, pairs in TORCH_SWAPS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for torch_name, ours_name in pairs:
            if hasattr(module, torch_name):
                originals.setdefault((module_name, torch_name), getattr(module, torch_name))
                if ours_name not in logged:
                    logged[ours_name] = _calls_logged(f"shardwise.{ours_name}", getattr(shardwise, ours_name))
                setattr(module, torch_name, logged[ours_name])
    for harness_name, restores in TORCH_HARNESS_RESTORE.items():
        try:
            harness = importlib.import_module(harness_name)
        except ImportError:
            continue
        for attr, module_name, torch_name in restores:
            if (module_name, torch_name) in originals:
                setattr(harness, attr, originals[(module_name, torch_name)])


def install_from_env() -> None:
    """Called by the sitecustomize on the path of a swapped run (and of every process it spawns)."""
    for peer in filter(None, os.environ.get("SHARDWISE_CONFORMANCE_SWAP", "").split(",")):
        if peer == "deepspeed":
            install_deepspeed()
        elif peer == "torch":
            install_torch()
        else:
            raise SystemExit(f"SHARDWISE_CONFORMANCE_SWAP: unknown peer {peer!r}; use deepspeed or torch")
