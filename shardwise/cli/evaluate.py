"""`shardwise eval RUN_DIR|CKPT [--data SPEC]`: the loss and perplexity of a trained checkpoint on a corpus, on one
process (any layout it was saved at), saying what it averaged over.

The corpus is read as `shardwise train` reads it and cut into consecutive, non-overlapping windows of the model's
sequence length; every next-token prediction of a window counts once. Without --data: the held-out split of the
run's own corpus (the last 5%, never trained on), and by default the very windows the run's `--eval-every`
evaluation read at that checkpoint (its first ones, wrapping around as the run's did), so the figure is the one
the run logged (up to the training dtype's rounding: eval runs in fp32). With --data, or --max-windows N: the
first N windows (default 256).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.cli.trained import add_checkpoint_arguments, load_trained, positive, run_args
from shardwise.errors import UserError

DEFAULT_WINDOWS = 256
"""Windows evaluated by default where the run logged no evaluation to match (--data, a run without one)."""
_TAG_STEP = re.compile(r"global_step(\d+)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="loss and perplexity of a trained checkpoint on a corpus",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument("--data", default=None,
                   help="corpus spec, as for train (default: the run's held-out split)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default: 8)")
    p.add_argument("--max-windows", type=int, default=None,
                   help="evaluate the first N windows (0: all of them; default: the windows of the run's held-out "
                        f"evaluation at this checkpoint, else {DEFAULT_WINDOWS})")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
    return p


@dataclass(frozen=True)
class RunEval:
    """The run's held-out evaluation at (or last before) the checkpoint's step, from its metrics.jsonl."""

    step: int
    loss: float
    windows: int | None       # None: the run's metrics do not record them


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


def run_evaluation(trained: Any) -> RunEval | None:
    """The evaluation the run logged at the checkpoint's step (or its last one before it), None if none."""
    from shardwise.cli.run_dir import METRICS_FILE
    from shardwise.telemetry import final_history, read_metrics

    if trained.run_dir is None or not (trained.run_dir / METRICS_FILE).is_file():
        return None
    match = _TAG_STEP.fullmatch(Path(trained.tag).name)
    until = int(match.group(1)) if match else None
    rows = [r for r in final_history(read_metrics(trained.run_dir / METRICS_FILE))
            if r.get("eval_loss") is not None and (until is None or int(r["step"]) <= until)]
    if not rows:
        return None
    last = rows[-1]
    windows = last.get("eval_windows")
    if windows is None:
        windows = _windows_before_they_were_logged(last, run_args(trained.run_dir))
    return RunEval(int(last["step"]), float(last["eval_loss"]), None if windows is None else int(windows))


def _windows_before_they_were_logged(row: dict[str, Any], saved: dict[str, Any] | None) -> int | None:
    """For metrics written before evaluations logged `eval_windows`: eval_batches * micro_batch * dp, from the
    step's global batch (`tokens` / seq_len = micro_batch * accumulation * dp) and the run's accumulation when its
    config fixes it; None when it does not (train_batch_size without gradient_accumulation_steps)."""
    if saved is None or not saved.get("eval_batches") or not isinstance(saved.get("config"), dict):
        return None
    config = saved["config"]
    accum = config.get("gradient_accumulation_steps")
    if accum is None and "train_batch_size" in config:
        return None
    global_batch, rest = divmod(int(row["tokens"]), int(saved["seq_len"]))
    per_micro_step, rest2 = divmod(global_batch, int(accum or 1))
    return None if rest or rest2 else int(saved["eval_batches"]) * per_micro_step


@dataclass(frozen=True)
class Chosen:
    """The windows to average over (indices into the corpus's windows) and how to say it."""

    indices: Any              # int64 [n]
    described: str
    of_run: bool              # the windows of the run's logged evaluation


def window_indices(num_windows: int, *, max_windows: int | None, logged: RunEval | None) -> Chosen:
    """The run's evaluation's windows (`logged`, wrapping around the `num_windows` as it did), or the first
    `max_windows` (0: all)."""
    import numpy as np

    from shardwise.data.heldout import read_windows
    if max_windows is None and logged is not None and logged.windows is not None:
        return Chosen(read_windows(logged.windows, num_windows),
                      f"the windows of the run's held-out evaluation at step {logged.step}", True)
    count = DEFAULT_WINDOWS if max_windows is None else (max_windows or num_windows)
    count = min(count, num_windows)
    what = f"the first {count} of {num_windows} windows"
    if max_windows is None and logged is not None:
        what += " (which windows the run's evaluation read is not known: its config sets train_batch_size " \
                "without gradient_accumulation_steps)"
    return Chosen(np.arange(count, dtype=np.int64), what, False)


def evaluate(model: Any, tokens: Any, *, seq_len: int, batch_size: int, windows: Any) -> dict[str, Any]:
    """Mean next-token cross-entropy over the windows [i s, (i + 1) s + 1) of `tokens`, i in `windows` (an index
    array; an index given twice counts twice), and its exp."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from shardwise.models.generate import logits_of
    total, count = 0.0, 0
    with torch.no_grad():
        for first in range(0, len(windows), batch_size):
            starts = np.asarray(windows[first:first + batch_size]) * seq_len
            rows = torch.from_numpy(np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64))
            logits = logits_of(model, rows[:, :-1]).float()                          # [b, s, vocab]
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1),
                                           reduction="sum"))
            count += rows[:, 1:].numel()
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf, "tokens": count,
            "windows": len(windows), "distinct_windows": len(set(int(i) for i in windows))}


def run(args: argparse.Namespace) -> int:
    positive("--batch-size", args.batch_size)
    positive("--max-windows", args.max_windows, zero_ok=True)
    trained = load_trained(args)
    tokens, what = _tokens(args, trained)
    seq_len = trained.choice.seq_len
    available = (len(tokens) - 1) // seq_len
    if available < 1:
        raise UserError(f"the corpus has {len(tokens)} tokens: fewer than one window of {seq_len + 1}")
    logged = run_evaluation(trained) if args.data is None else None
    chosen = window_indices(available, max_windows=args.max_windows, logged=logged)
    result = evaluate(trained.model, tokens, seq_len=seq_len, batch_size=args.batch_size, windows=chosen.indices)
    run_loss = logged.loss if chosen.of_run and logged is not None else None
    result.update(checkpoint=str(trained.tag), data=what, data_tokens=len(tokens), averaged_over=chosen.described,
                  run_eval_loss=run_loss)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    repeats = result["windows"] - result["distinct_windows"]
    again = f" ({repeats} repeated: the run's evaluation wrapped around the {available})" if repeats else ""
    print(f"{trained.tag}: on {what}, {len(tokens):,} tokens; {chosen.described}: {result['windows']} windows of "
          f"{seq_len} tokens{again}, {result['tokens']:,} predictions: loss {result['loss']:.4f}, perplexity "
          f"{result['perplexity']:.3f}")
    if run_loss is not None and logged is not None:
        match = _TAG_STEP.fullmatch(Path(trained.tag).name)
        other = f"; this checkpoint is of step {match.group(1)}" if match and int(match.group(1)) != logged.step \
            else ""
        print(f"the run logged eval loss {run_loss:.4f} on these windows at step {logged.step} (in its training "
              f"dtype, on its ranks{other})")
    return 0
