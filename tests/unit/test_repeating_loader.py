"""`engine.repeating`: DeepSpeed's RepeatingLoader, behind `engine.train_batch()` without an iterator."""

from __future__ import annotations

import pytest

from shardwise.engine.engine import repeating
from shardwise.errors import UserError


class _Sampler:
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class _Loader:
    """Yields its epoch's number n times: which epoch a batch came from shows in the batch."""

    def __init__(self, n: int) -> None:
        self.sampler = _Sampler()
        self.n = n

    def __iter__(self):
        return iter([self.sampler.epochs[-1]] * self.n)


def test_repeating_starts_over_with_the_next_epoch() -> None:
    loader = _Loader(2)
    it = repeating(loader)
    assert [next(it) for _ in range(5)] == [0, 0, 1, 1, 2]
    assert loader.sampler.epochs == [0, 1, 2]


def test_repeating_an_empty_loader_says_why() -> None:
    with pytest.raises(UserError, match="gives no batch on this rank"):
        next(repeating(_Loader(0)))


def test_repeating_a_loader_without_sampler() -> None:
    it = repeating([1, 2])
    assert [next(it) for _ in range(5)] == [1, 2, 1, 2, 1]
