"""`shardwise` command line entry point: argparse with one module per subcommand.

A subcommand module exposes ``add_parser(subparsers)``, which registers its parser with
``set_defaults(func=run)``, where ``run(args) -> int`` is the exit code. To add a subcommand,
write the module and add it to SUBCOMMANDS below.

User errors (`UserError`, which `ConfigError` subclasses) print ``shardwise: error: ...`` on stderr, one
line per problem, and exit 2, like argparse's own usage errors; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import Sequence

import shardwise
from shardwise.cli import bench, check_config, evaluate, export, generate, plan, schedule, train
from shardwise.errors import UserError

# ----- the subcommands, in the order `shardwise --help` lists them -----
SUBCOMMANDS: list[ModuleType] = [
    train,
    evaluate,
    generate,
    export,
    check_config,
    bench,
    plan,
    schedule,
]

EXIT_USER_ERROR = 2
EXIT_SIGINT = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Distributed training of transformer language models on torch.distributed, "
                    "configured with DeepSpeed-style JSON.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {shardwise.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def _lines(error: BaseException) -> list[str]:
    """The error's problems, one per line (a ConfigError's str already has one problem per line)."""
    return [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (argparse's own errors exit 2 via SystemExit)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UserError as error:
        for line in _lines(error):
            print(f"shardwise: error: {line}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:      # Ctrl-C before the ranks started (a running run answers it in `train`)
        print("shardwise: interrupted", file=sys.stderr)
        return EXIT_SIGINT


if __name__ == "__main__":
    sys.exit(main())
