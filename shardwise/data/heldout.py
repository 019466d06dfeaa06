"""A held-out split of a corpus for evaluation, and the fixed windows an evaluation reads.

The split is positional and deterministic: the last `HELD_OUT_FRACTION` of the token array (at least one window)
is held out, training samples windows from the tokens before it only, so no held-out token is ever trained on
(a training window ends at most at the split). Every evaluation reads the same windows: consecutive,
non-overlapping `seq_len + 1`-token windows of the held-out part, dealt to data-parallel ranks as the training
loader deals a global batch (micro-step k of rank r takes windows [(k * dp + r) * micro, ... + micro)), wrapping
around when an evaluation asks for more windows than there are. An evaluation of K micro-batches per rank thus
averages windows 0, 1, ..., K * dp * micro_batch - 1 (modulo the number of windows: `read_windows`), whatever the
layout; `shardwise eval` reads the same ones to give the same figure.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from shardwise.data.corpora import CorpusError, check_length
from shardwise.data.loader import Batch

HELD_OUT_FRACTION = 0.05
"""Share of the corpus (its last tokens) kept for evaluation when a run evaluates."""


def read_windows(count: int, num_windows: int) -> np.ndarray:
    """The window indices [count] an evaluation of `count` windows averages over: 0, 1, ... wrapping around
    `num_windows` (a window read twice counts twice)."""
    return np.arange(count, dtype=np.int64) % num_windows


def split_held_out(tokens: np.ndarray, seq_len: int,
                   fraction: float = HELD_OUT_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens): views of `tokens` (a memmap stays a memmap), split at
    len - max(seq_len + 1, fraction * len). CorpusError when the training part would hold no window."""
    n = len(tokens)
    held = max(seq_len + 1, int(n * fraction))
    if n - held < seq_len + 1:
        raise CorpusError(f"corpus has {n} tokens: too few to hold out {held} for evaluation and keep a training "
                          f"window of {seq_len + 1}; use a corpus of at least {held + seq_len + 1} tokens, or "
                          f"train without --eval-every.")
    return tokens[:n - held], tokens[n - held:]


class EvalWindows:
    """The same micro-batches at every evaluation: `batches()` starts over each time."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, micro_batch: int, dp_size: int = 1,
                 dp_rank: int = 0) -> None:
        check_length(tokens, seq_len)
        self.tokens, self.seq_len, self.micro_batch = tokens, seq_len, micro_batch
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.num_windows = (len(tokens) - 1) // seq_len      # window i: tokens [i s, (i + 1) s + 1)

    def windows_read(self, num_micro_batches: int) -> int:
        """Windows an evaluation of `num_micro_batches` micro-batches per rank averages over, all ranks together."""
        return num_micro_batches * self.dp_size * self.micro_batch

    def micro_batch_at(self, k: int) -> Batch:
        """Micro-step k of this rank: (input_ids, labels), int64 [micro_batch, seq_len] each."""
        first = (k * self.dp_size + self.dp_rank) * self.micro_batch
        starts = read_windows(first + self.micro_batch, self.num_windows)[first:] * self.seq_len
        idx = starts[:, None] + np.arange(self.seq_len + 1)                      # [micro, seq_len + 1]
        window = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def batches(self) -> Iterator[Batch]:
        k = 0
        while True:
            yield self.micro_batch_at(k)
            k += 1
