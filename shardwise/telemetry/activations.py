"""Measured, not assumed: the bytes of the tensors autograd saves for backward.

    meter = ActivationMeter(follow=True)
    with meter.track(key, exclude):   # a forward: what autograd saves here counts for `key`
        loss = model(batch)
    meter.sample()                    # after a forward: peak keys in flight and bytes
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import Tensor


def storage_key(t: Tensor) -> int | None:
    """The identity of `t`'s storage (shared by all its views); None for tensors without one (meta, sparse).
    The StorageImpl identity survives the resize-to-0-and-back of ZeRO-3's gathered buffers and of a pipeline's
    freed outputs, where the data pointer changes."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


class ActivationMeter:
    """Tensors autograd saves for backward, per key.

    What autograd saves inside `track(key)` counts for `key` (the engine's forward, a pipeline's micro-batch),
    each storage counted once: some ops save many views of one buffer. Parameters and data batches are excluded
    by the caller's `exclude`.

    With `follow=True` each saved tensor is also followed (a weak reference) until freed, which gives the peak
    count of keys in flight and their bytes: saved activations appear only during a forward and disappear only
    during a backward, so both peaks are reached right after some forward, where the caller calls `sample()`.
    Following costs a weak reference per saved tensor (about 3% of a CPU step), so pipelines follow one step in
    a few; the engine's own forward only counts.
    """

    def __init__(self, *, follow: bool = False) -> None:
        self.follow = follow
        self._storages: dict[Hashable, dict[int, int]] = {}   # key -> storage key -> bytes (each counted once)
        self._refs: dict[Hashable, list[weakref.ref]] = {}     # key -> its saved tensors (with follow)
        self.peak_count = 0
        self.peak_bytes = 0

    @contextlib.contextmanager
    def track(self, key: Hashable, exclude: Callable[[int, Tensor], bool]) -> Iterator[None]:
        """Attribute to `key` what autograd saves in this block, except the storages `exclude(storage_key,
        tensor)` names (parameters, data batches: they outlive the key by design). `exclude` is asked once
        per storage not seen yet."""
        storages = self._storages.setdefault(key, {})
        refs = self._refs.setdefault(key, []) if self.follow else None

        def pack(t: Tensor) -> Tensor:
            k = storage_key(t)
            if k is None:
                return t
            if k not in storages:
                if exclude(k, t):
                    return t
                storages[k] = t.untyped_storage().nbytes()
            if refs is not None:
                refs.append(weakref.ref(t))
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                yield
        finally:
            if not storages:     # nothing saved: never in flight
                self.forget(key)

    def bytes_of(self, key: Hashable) -> int:
        return sum(self._storages.get(key, {}).values())

    def saved_storages(self, key: Hashable) -> set[int]:
        """Storage keys autograd saved for `key` so far."""
        return set(self._storages.get(key, ()))

    def forget(self, key: Hashable) -> None:
        self._storages.pop(key, None)
        self._refs.pop(key, None)

    # -- with follow: what is still in flight --------------------------------------------------------------
    @property
    def live_keys(self) -> list[Any]:
        self._prune()
        return list(self._refs)

    def reset_peaks(self) -> None:
        self._prune()
        self.peak_count, self.peak_bytes = len(self._refs), self._bytes()

    def sample(self) -> None:
        self._prune()
        self.peak_count = max(self.peak_count, len(self._refs))
        self.peak_bytes = max(self.peak_bytes, self._bytes())

    def _prune(self) -> None:
        for key in [k for k, refs in self._refs.items() if not any(r() is not None for r in refs)]:
            self.forget(key)

    def _bytes(self) -> int:
        return sum(sum(s.values()) for s in self._storages.values())


def _unpack(t: Tensor) -> Tensor:
    return t


class SavedTensorMeter:
    """The engine's: bytes autograd saves during one training forward, parameters excluded, including the
    buffers ZeRO-3 gathers meanwhile (`gathered_keys`, asked when a storage is first seen)."""

    def __init__(self, gathered_keys: Callable[[], set[int]]):
        self._gathered_keys = gathered_keys
        self._meter = ActivationMeter()
        self._params: set[int] = set()
        self.bytes = 0

    @contextlib.contextmanager
    def measuring(self, params: list[Tensor]) -> Iterator[None]:
        self._meter.forget(0)
        self._params = {k for k in map(storage_key, params) if k is not None} | self._gathered_keys()
        with self._meter.track(0, self._is_param):
            yield
        self.bytes = self._meter.bytes_of(0)

    def _is_param(self, key: int, t: Tensor) -> bool:
        if key in self._params:
            return True
        if isinstance(t, torch.nn.Parameter) or key in self._gathered_keys():
            self._params.add(key)
            return True
        return False
