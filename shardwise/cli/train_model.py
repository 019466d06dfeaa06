"""The model and the data of one `shardwise train` rank: the model `--model` resolved to (RUN_DIR/model.json),
the training tokens and, with `--eval-every`, the held-out split and its evaluation.

    choice, model = build_run_model(args)                 # the caller seeded torch
    data = RunData.build(tokens, args, choice, engine)    # train_batches for engine.train_batch
    extra = data.evaluate(engine, step)                   # {"eval_loss", "eval_perplexity"} on eval steps
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.data import TokenLoader
from shardwise.data.heldout import EvalWindows, split_held_out
from shardwise.models.registry import MODEL_FILE, ModelChoice, build_model, model_batches, resolve_model


def run_model_choice(args: Any) -> ModelChoice:
    """The model the parent resolved (RUN_DIR/model.json), or `--model` resolved again when the run directory
    has none (arguments written by an older parent)."""
    path = Path(args.out) / MODEL_FILE
    if path.is_file():
        return ModelChoice.read(path)
    return resolve_model(args.model, seq_len=args.seq_len, vocab_size=getattr(args, "vocab_size", None))


def build_run_model(args: Any) -> tuple[ModelChoice, Any]:
    """The run's model in train mode, whatever mode its loader returned it in: transformers' `from_pretrained`
    returns an eval-mode model, which would train with dropout off, and the engine measures activations and
    opens each step's communication record only in a training forward."""
    choice = run_model_choice(args)
    return choice, build_model(choice).train()


def perplexity(loss: float) -> float:
    """exp(mean next-token cross-entropy); inf when the loss is too large for a float."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@dataclass
class RunData:
    """This rank's training batches and, when the run evaluates, its fixed evaluation windows."""

    choice: ModelChoice
    loader: TokenLoader               # the training loader (its state_dict is the data position)
    train_batches: Any                # what engine.train_batch reads: the loader, or its HF keyword batches
    eval_windows: EvalWindows | None
    eval_every: int
    eval_batches: int

    @classmethod
    def build(cls, tokens: np.ndarray, args: Any, choice: ModelChoice, engine: Any) -> "RunData":
        batch = engine.config.batch
        eval_every = int(getattr(args, "eval_every", 0) or 0)
        held = None
        if eval_every:
            tokens, held = split_held_out(tokens, args.seq_len)
        loader = TokenLoader(tokens, seq_len=args.seq_len, micro_batch=batch.micro_batch,
                             grad_accum=batch.grad_accum, dp_size=engine.dp_size, dp_rank=engine.dp_rank,
                             seed=args.seed)
        windows = None if held is None else EvalWindows(held, seq_len=args.seq_len, micro_batch=batch.micro_batch,
                                                        dp_size=engine.dp_size, dp_rank=engine.dp_rank)
        return cls(choice, loader, model_batches(choice, loader), windows, eval_every,
                   int(getattr(args, "eval_batches", 0) or 0))

    def evaluate(self, engine: Any, step: int, last_step: int) -> dict[str, float]:
        """On every `eval_every`-th step and the last one: the held-out mean loss and perplexity, the same on
        every rank (collective: every rank calls it at every step), and what they averaged over: `eval_windows`
        windows (the held-out split's first ones, wrapping around: `read_windows`) of `seq_len` predictions each,
        `eval_tokens` predictions in all. {} on other steps."""
        if self.eval_windows is None or not (step % self.eval_every == 0 or step == last_step):
            return {}
        batches = model_batches(self.choice, self.eval_windows.batches())
        loss = float(engine.eval_batch(batches, num_micro_batches=self.eval_batches))
        windows = self.eval_windows.windows_read(self.eval_batches)
        return {"eval_loss": loss, "eval_perplexity": perplexity(loss), "eval_windows": windows,
                "eval_tokens": windows * self.eval_windows.seq_len}
