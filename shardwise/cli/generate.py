"""`shardwise generate RUN_DIR|CKPT --prompt "..." --max-new-tokens N --temperature T --top-k K`: sample from a
trained checkpoint on one process (any layout it was saved at).

Byte-level models (vocabulary 256: the tokenizer of text corpora) take the prompt as text and print text; a model
trained on token ids takes `--prompt-ids 1,2,3` and prints ids.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shardwise.cli.trained import add_checkpoint_arguments, load_trained, positive
from shardwise.errors import UserError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="sample text from a trained checkpoint (one process, any layout)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument("--prompt", default=None, help="text to continue (byte-level models)")
    p.add_argument("--prompt-ids", default=None, metavar="ID,ID,...", help="token ids to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy; higher: more random (default: 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K likeliest tokens (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: 0)")
    p.set_defaults(func=run)
    return p


def _prompt_ids(args: argparse.Namespace, vocab_size: int) -> list[int]:
    from shardwise.data import ByteTokenizer
    if (args.prompt is None) == (args.prompt_ids is None):
        raise UserError("give exactly one of --prompt TEXT and --prompt-ids ID,ID,...")
    if args.prompt is not None:
        if vocab_size < ByteTokenizer.vocab_size:
            raise UserError(f"--prompt: this model's vocabulary has {vocab_size} ids, fewer than the 256 bytes of "
                            f"text; give --prompt-ids")
        ids = ByteTokenizer().encode(args.prompt)
    else:
        try:
            ids = [int(x) for x in args.prompt_ids.replace(" ", "").split(",") if x]
        except ValueError:
            raise UserError(f"--prompt-ids {args.prompt_ids!r}: give integers separated by commas") from None
    if not ids:
        raise UserError("the prompt is empty: give at least one token")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UserError(f"--prompt-ids: id {bad[0]} is outside the model's vocabulary 0..{vocab_size - 1}")
    return ids


def run(args: argparse.Namespace) -> int:
    positive("--max-new-tokens", args.max_new_tokens, zero_ok=True)
    positive("--top-k", args.top_k)
    if not args.temperature >= 0:
        raise UserError(f"--temperature {args.temperature}: must be 0 (greedy) or more")
    import torch

    from shardwise.data import ByteTokenizer
    from shardwise.models.generate import generate
    trained = load_trained(args)
    ids = _prompt_ids(args, trained.choice.vocab_size)
    out = generate(trained.model, torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                   context=trained.choice.seq_len, temperature=args.temperature, top_k=args.top_k,
                   generator=torch.Generator().manual_seed(args.seed))[0].tolist()
    if args.prompt is not None and trained.choice.vocab_size == ByteTokenizer.vocab_size:
        sys.stdout.write(ByteTokenizer().decode(out) + "\n")
    else:
        print(",".join(str(i) for i in out))
    return 0
