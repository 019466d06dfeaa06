"""DeepSpeed's command-line flags for user scripts: `shardwise.add_config_arguments(parser)`.

    parser = argparse.ArgumentParser()
    parser = shardwise.add_config_arguments(parser)
    args = parser.parse_args()
    engine, *_ = shardwise.initialize(args=args, model=model, model_parameters=model.parameters())

`initialize` reads the config from `args.deepspeed_config` (or the deprecated `args.deepscale_config`). The
`--deepspeed` / `--deepscale` switches are for the script's own use, as in DeepSpeed. No torch import here.
"""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's group of flags to `parser` and return it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a switch for the script; shardwise itself does not read it)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="the DeepSpeed JSON config file that shardwise.initialize(args=...) reads")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="deprecated spelling of --deepspeed_config")
    return parser
