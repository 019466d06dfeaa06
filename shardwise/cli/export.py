"""`shardwise export RUN_DIR|CKPT --to safetensors|hf --out DIR`: the consolidated weights of a checkpoint (any
layout), for other tools.

    --to hf            a Hugging Face model directory (config.json + model.safetensors, `save_pretrained`):
                       `AutoModelForCausalLM.from_pretrained(DIR)` loads it. Our GPT shape becomes
                       GPT2LMHeadModel, our Llama shape LlamaForCausalLM, its MoE form (llama-moe-tiny)
                       MixtralForCausalLM; a `--model hf:...` run stays its class. A model transformers has
                       no counterpart of (GELU experts: gpt-moe-tiny) is refused before any weight is read.
    --to safetensors   DIR/model.safetensors under our own names, with DIR/model.json (what `--model` it is)
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from shardwise.cli.trained import add_checkpoint_arguments, load_trained, model_choice
from shardwise.errors import UserError

FORMATS = ("hf", "safetensors")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a checkpoint's weights as a Hugging Face model or safetensors",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument("--to", choices=FORMATS, required=True, help="hf: a transformers model directory; "
                                                               "safetensors: our names")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (created; must be empty)")
    p.set_defaults(func=run)
    return p


def _check_out(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"--out {str(path)!r} exists and is not an empty directory; choose a new directory "
                        f"(an export never overwrites files)")


def _write_hf(trained: Any, tmp: Path) -> None:
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()          # one line per export is enough
    if trained.choice.is_hf:
        trained.model.save_pretrained(str(tmp))
        return
    from transformers import AutoModelForCausalLM

    from shardwise.models.hf import hf_config, to_hf_state_dict
    cfg = trained.choice.gpt_config()
    hf = AutoModelForCausalLM.from_config(hf_config(cfg))
    hf.load_state_dict(to_hf_state_dict(cfg, trained.model.state_dict()), strict=not cfg.tie_embeddings)
    hf.save_pretrained(str(tmp))


def _write_safetensors(trained: Any, tmp: Path) -> None:
    from safetensors.torch import save_file

    from shardwise.models.registry import MODEL_FILE
    # safetensors refuses tensors sharing memory (a tied head): each name gets its own copy.
    save_file({k: v.detach().contiguous().clone() for k, v in trained.model.state_dict().items()},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    trained.choice.write(tmp / MODEL_FILE)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    _check_out(out)
    if args.to == "safetensors":
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise UserError("--to safetensors needs the safetensors package: pip install safetensors") from None
    elif args.to == "hf":
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise UserError("--to hf needs transformers: pip install transformers") from None
        from shardwise.models.hf import hf_family
        choice, _ = model_choice(args)
        if not choice.is_hf:
            hf_family(choice.gpt_config())      # no transformers counterpart: one line before any weight is read
    trained = load_trained(args)
    # Written beside the destination and renamed into place: a failed export leaves nothing half-written.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (_write_hf if args.to == "hf" else _write_safetensors)(trained, tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out} ({args.to}) from {trained.tag}")
    return 0
