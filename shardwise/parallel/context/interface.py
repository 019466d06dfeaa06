"""What the engine and the models see of context parallelism: two small interfaces.

`ContextAttention` is attention over a sequence split across the cp ranks (`RingAttention`, `UlyssesAttention`);
a model's attention core calls it in place of its own. `BatchPart` is how the step driver takes this rank's part of
a micro-batch that every cp rank was given whole (`ContextParallel`; `WholeBatch` without cp).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from shardwise.parallel.context.layout import SequenceLayout


class ContextAttention(Protocol):
    """softmax(q k^T / sqrt(D) [+ causal mask]) v over the whole sequence, called with this rank's part of it:
    q [B, H, S/C, D], k, v [B, Hkv, S/C, D] (Hkv divides H: grouped-query heads) -> [B, H, S/C, D]."""

    @property
    def layout(self) -> SequenceLayout:
        """Which tokens this rank holds."""
        ...

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor: ...


class BatchPart(Protocol):
    """This rank's part of a micro-batch's (positional, keyword) model arguments."""

    def local_batch(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ...


class WholeBatch:
    """Without context parallelism: the micro-batch as it is."""

    def local_batch(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return inputs, kwargs
