"""Deterministic, data-parallel-aware sampling of training windows from a flat token array.

The rule that makes parity tests possible: the global batch of step t depends only on (seed, t),
never on how it is split. A generator seeded with (seed, t) draws the B = grad_accum * dp_size *
micro_batch window offsets of the whole step; rank r's micro-step k takes rows

    [(k * dp_size + r) * micro_batch, (k * dp_size + r + 1) * micro_batch)

of it (the same slicing as `shardwise.testing.shard_global_batch`). So the union over ranks of a
step's micro-batches is the same set of windows for dp = 1, 2, 4, ... and a single-process reference
can train on `global_batch(t)` directly.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor

from shardwise.data.corpora import check_length

Batch = tuple[Tensor, Tensor]
"""(input_ids, labels), both int64 [rows, seq_len]; labels[:, i] is the token after input_ids[:, i]."""


class TokenLoader:
    """Endless iterator of this rank's micro-batches: step 0 micro 0 .. grad_accum-1, step 1, ...

    Each window is seq_len + 1 consecutive tokens at a random offset: inputs are its first seq_len
    tokens, labels its last seq_len. Windows may overlap and repeat (sampling with replacement);
    every token position can start a window.
    """

    def __init__(self, tokens: np.ndarray | Tensor, *, seq_len: int, micro_batch: int, grad_accum: int = 1,
                 dp_size: int = 1, dp_rank: int = 0, seed: int = 0) -> None:
        for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("grad_accum", grad_accum),
                            ("dp_size", dp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TokenLoader: {name}={value!r} must be a positive integer.")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"TokenLoader: dp_rank={dp_rank!r} must be in 0..{dp_size - 1} (dp_size={dp_size}).")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"TokenLoader: seed={seed!r} must be a non-negative integer.")
        if isinstance(tokens, Tensor):
            tokens = tokens.detach().cpu().numpy()
        if not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise ValueError(f"TokenLoader: tokens must be a 1-D integer array, got shape {tokens.shape} "
                             f"dtype {tokens.dtype}.")
        check_length(tokens, seq_len)
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.step = 0
        """Global step of the next micro-batch `next()` returns."""
        self.micro_step = 0
        """Its index within that step, 0 .. grad_accum - 1."""

    @property
    def global_batch_size(self) -> int:
        """Windows per optimizer step over all ranks: grad_accum * dp_size * micro_batch."""
        return self.grad_accum * self.dp_size * self.micro_batch

    def offsets(self, step: int) -> np.ndarray:
        """Start positions [global_batch_size] of step `step`'s windows, in global-batch row order."""
        if step < 0:
            raise ValueError(f"TokenLoader: step={step} must be >= 0.")
        rng = np.random.default_rng([self.seed, step])
        # A window needs seq_len + 1 tokens, so the last valid start is len - seq_len - 1 (high is exclusive).
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch_size, dtype=np.int64)

    def _windows(self, offsets: np.ndarray) -> Batch:
        idx = offsets[:, None] + np.arange(self.seq_len + 1)             # [rows, seq_len + 1]
        window = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()   # inputs, labels [rows, seq_len]

    def global_batch(self, step: int) -> Batch:
        """Every rank's windows of `step` together, [global_batch_size, seq_len] each: what a
        single-process reference trains on."""
        return self._windows(self.offsets(step))

    def micro_batches(self, step: int) -> list[Batch]:
        """This rank's grad_accum micro-batches of `step`, each [micro_batch, seq_len]."""
        offs, mb = self.offsets(step), self.micro_batch
        return [self._windows(offs[(k * self.dp_size + self.dp_rank) * mb:][:mb]) for k in range(self.grad_accum)]

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        offs, mb = self.offsets(self.step), self.micro_batch
        row = (self.micro_step * self.dp_size + self.dp_rank) * mb
        batch = self._windows(offs[row:row + mb])
        self.micro_step += 1
        if self.micro_step == self.grad_accum:
            self.step, self.micro_step = self.step + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Position of the next micro-batch (and the seed it belongs to); resumes exactly."""
        return {"step": self.step, "micro_step": self.micro_step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`. dp_size may differ from the saved run (the global batches do
        not depend on it); a different seed would silently change the data, so it is refused."""
        if "seed" in state and state["seed"] != self.seed:
            raise ValueError(f"TokenLoader.load_state_dict: the state was saved with seed={state['seed']} but "
                             f"this loader has seed={self.seed}; resuming would draw different batches. "
                             f"Build the loader with seed={state['seed']}, or drop 'seed' from the state "
                             f"to switch data on purpose.")
        step, micro = int(state["step"]), int(state.get("micro_step", 0))
        if step < 0 or not 0 <= micro < self.grad_accum:
            raise ValueError(f"TokenLoader.load_state_dict: step={step}, micro_step={micro} is not a position "
                             f"of this loader (step >= 0, 0 <= micro_step < grad_accum={self.grad_accum}).")
        self.step, self.micro_step = step, micro
