"""A trained model on one process, for `shardwise eval`, `generate` and `export`: the checkpoint named on the
command line (a run directory, its checkpoints directory or one tag), consolidated from whatever layout wrote it
(`shardwise.checkpoint.consolidate`), in the model RUN_DIR/model.json describes (or `--model` when there is none)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.errors import UserError


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="RUN_DIR|CKPT",
                   help="a run directory of `shardwise train --save-every`, its checkpoints directory (the tag "
                        "`latest` names) or one checkpoint tag directory; any layout (dp, ZeRO, tp, pp)")
    p.add_argument("--model", default=None,
                   help="the --model it was trained with, when the checkpoint is not inside a run directory "
                        "(which records it in model.json)")
    p.add_argument("--seq-len", type=int, default=None, help="with --model: the --seq-len it was trained with")
    p.add_argument("--vocab-size", type=int, default=None, help="with --model: the --vocab-size it was trained with")


@dataclass
class Trained:
    choice: Any            # shardwise.models.registry.ModelChoice
    model: Any             # fp32, eval mode, on the CPU
    tag: Path              # the checkpoint tag directory read
    run_dir: Path | None   # the run directory holding model.json, if any


def model_choice(args: argparse.Namespace) -> tuple[Any, Path | None]:
    from shardwise.models.registry import ModelChoice, find_model_file, resolve_model
    if not Path(args.checkpoint).expanduser().exists():
        raise UserError(f"{args.checkpoint!r}: no such run directory or checkpoint")
    if args.model is not None:
        return resolve_model(args.model, seq_len=args.seq_len, vocab_size=args.vocab_size), None
    found = find_model_file(Path(args.checkpoint).expanduser().resolve())
    if found is None:
        raise UserError(f"{args.checkpoint!r}: no model.json in it or above it (a run directory of `shardwise "
                        f"train` has one); pass --model NAME (and --seq-len / --vocab-size as trained)")
    return ModelChoice.read(found), found.parent


def load_trained(args: argparse.Namespace) -> Trained:
    """Build the model and load the consolidated checkpoint into it (UserError on any mismatch)."""
    import torch

    from shardwise.checkpoint.consolidate import consolidated_state_dict, load_weights, resolve_checkpoint
    from shardwise.models.registry import build_model
    choice, run_dir = model_choice(args)
    tag = resolve_checkpoint(args.checkpoint)
    torch.manual_seed(0)      # the build's random init is overwritten by the checkpoint
    model = build_model(dataclasses.replace(choice, hf_weights=False))
    load_weights(model, consolidated_state_dict(tag, reference=model))
    return Trained(choice, model.float().eval(), tag, run_dir)


def run_args(run_dir: Path | None) -> dict[str, Any] | None:
    """The run's train_args.json (data spec, seed, eval split), when the checkpoint is inside a run directory."""
    if run_dir is None:
        return None
    files = sorted(run_dir.glob("train_args*.json"))
    return json.loads(files[0].read_text(encoding="utf-8")) if files else None


def positive(flag: str, value: int | float | None, *, zero_ok: bool = False) -> None:
    if value is not None and (value < 0 if zero_ok else value < 1):
        raise UserError(f"{flag} {value}: must be {'0 or more' if zero_ok else 'at least 1'}.")
