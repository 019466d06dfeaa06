"""Measured, not assumed: how many micro-batches of activations a pipeline stage holds at once, and their bytes.

`ActivationMeter` follows every tensor autograd saves during each forward (a saved-tensors hook keeps a weak
reference and its storage's size; parameters and data batches excluded) until it is freed. The hook runs on
every saved tensor, which costs about 3% of a CPU step, so the runtime meters one step in `measure_every`
(the schedule and the shapes are fixed, and so are the figures).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch import Tensor


class ActivationMeter:
    """Tensors autograd saves for backward, per key, followed until they are freed.

    The pack hook runs on every saved tensor, so it only keeps a weak reference and its storage's size;
    `sample()`, called after each forward, drops the keys whose saved tensors are all gone and updates the
    peaks. That gives the exact peaks: saved activations appear only during a forward and disappear only
    during a backward, so their count and bytes are largest right after some forward.
    """

    def __init__(self) -> None:
        self._refs: dict[Any, list[weakref.ref]] = {}      # key -> weak references to its saved tensors
        self._storages: dict[Any, dict[int, int]] = {}     # key -> storage pointer -> bytes (each counted once)
        self.peak_count = 0
        self.peak_bytes = 0

    def reset_peaks(self) -> None:
        self._prune()
        self.peak_count, self.peak_bytes = len(self._refs), self._bytes()

    @property
    def live_keys(self) -> list[Any]:
        self._prune()
        return list(self._refs)

    def saved_storages(self, key: Any) -> set[int]:
        """Storages (data pointers) autograd saved for ``key`` so far."""
        return set(self._storages.get(key, ()))

    def sample(self) -> None:
        self._prune()
        self.peak_count = max(self.peak_count, len(self._refs))
        self.peak_bytes = max(self.peak_bytes, self._bytes())

    @contextlib.contextmanager
    def track(self, key: Any, skip: set[int]) -> Iterator[None]:
        """Attribute to ``key`` what autograd saves in this block, except the storages in ``skip``
        (parameters, data batches: they outlive the micro-batch by design)."""
        refs = self._refs.setdefault(key, [])
        storages = self._storages.setdefault(key, {})

        def pack(t: Tensor) -> Tensor:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):   # tensors without storage (meta, sparse)
                return t
            ptr = storage.data_ptr()
            if ptr in skip:
                return t
            refs.append(weakref.ref(t))
            if ptr not in storages:
                storages[ptr] = storage.nbytes()
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            if not refs:   # nothing saved: never in flight
                del self._refs[key], self._storages[key]

    def _prune(self) -> None:
        for key in [k for k, refs in self._refs.items() if not any(r() is not None for r in refs)]:
            del self._refs[key], self._storages[key]

    def _bytes(self) -> int:
        return sum(sum(s.values()) for s in self._storages.values())
