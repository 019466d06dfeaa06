"""DeepSpeed's `RepeatingLoader` (`deepspeed.utils.RepeatingLoader`): a loader iterated without end."""

from __future__ import annotations

from typing import Any, Iterable, Iterator


class RepeatingLoader:
    """The batches of `loader`, started over (a new `iter(loader)`) each time it is exhausted, as DeepSpeed's:
    `loader` and the live `data_iter` are its attributes. A loader whose sampler reshuffles per epoch needs its
    `set_epoch` called by the script, as with DeepSpeed's."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)    # an empty loader ends here with StopIteration, as DeepSpeed's does
