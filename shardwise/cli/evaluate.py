"""`shardwise eval RUN_DIR|CKPT [--data SPEC]`: the loss and perplexity of a trained checkpoint on a corpus, on one
process (any layout it was saved at).

The corpus is read as `shardwise train` reads it and cut into consecutive, non-overlapping windows of the model's
sequence length (the first --max-windows of them); every next-token prediction counts once. Without --data: the
held-out split of the run's own corpus (the last 5%, never trained on), whose first windows are the ones the run's
`--eval-every` evaluations read.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from shardwise.cli.trained import add_checkpoint_arguments, load_trained, positive, run_args
from shardwise.errors import UserError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="loss and perplexity of a trained checkpoint on a corpus",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument("--data", default=None,
                   help="corpus spec, as for train (default: the run's held-out split)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default: 8)")
    p.add_argument("--max-windows", type=int, default=256,
                   help="evaluate the first N windows (default: %(default)s; 0: all of them)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
    return p


def _tokens(args: argparse.Namespace, trained: Any) -> tuple[Any, str]:
    from shardwise.data import CorpusError, load_corpus
    from shardwise.data.heldout import split_held_out
    try:
        if args.data is not None:
            return load_corpus(args.data, vocab_size=trained.choice.vocab_size), args.data
        saved = run_args(trained.run_dir)
        if saved is None or not saved.get("eval_every"):
            raise UserError("give --data SPEC: this checkpoint's run held out no split (it trained without "
                            "--eval-every), so every token of its corpus was trained on")
        _, held = split_held_out(load_corpus(saved["data"]), int(saved["seq_len"]))
        return held, f"{saved['data']} (held-out split)"
    except CorpusError as e:
        raise UserError(f"--data: {e}") from None


def evaluate(model: Any, tokens: Any, *, seq_len: int, batch_size: int, max_windows: int | None) -> dict[str, Any]:
    """Mean next-token cross-entropy over consecutive windows [i s, (i + 1) s + 1) of `tokens`, and its exp."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from shardwise.models.generate import logits_of
    windows = (len(tokens) - 1) // seq_len
    if windows < 1:
        raise UserError(f"the corpus has {len(tokens)} tokens: fewer than one window of {seq_len + 1}")
    if max_windows is not None:
        windows = min(windows, max_windows)
    total, count = 0.0, 0
    with torch.no_grad():
        for first in range(0, windows, batch_size):
            starts = np.arange(first, min(first + batch_size, windows)) * seq_len
            rows = torch.from_numpy(np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64))
            logits = logits_of(model, rows[:, :-1]).float()                          # [b, s, vocab]
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1),
                                           reduction="sum"))
            count += rows[:, 1:].numel()
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf, "tokens": count,
            "windows": windows}


def run(args: argparse.Namespace) -> int:
    positive("--batch-size", args.batch_size)
    positive("--max-windows", args.max_windows, zero_ok=True)
    trained = load_trained(args)
    tokens, what = _tokens(args, trained)
    result = evaluate(trained.model, tokens, seq_len=trained.choice.seq_len, batch_size=args.batch_size,
                      max_windows=args.max_windows or None)
    result.update(checkpoint=str(trained.tag), data=what)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{trained.tag}: on {what}, {result['tokens']:,} tokens in {result['windows']} windows: "
              f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f}")
    return 0
