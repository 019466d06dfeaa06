"""The `shardwise train` command line that runs a plan `shardwise plan --write-config` wrote: the model as the plan
named it, the job's sequence length, and the world as nodes x processes per node (torchrun starts the same number
of processes on every node), one command per node when there are several."""

from __future__ import annotations

import argparse
import math
import shlex
from typing import Any


def train_command(args: argparse.Namespace, config_path: str, world_size: int, gpus_per_node: int) -> str:
    """The command, complete: `--model` (the preset, or hf:CONFIG.json), `--seq-len` when the job set one, and
    `--nproc` (one node) or `--nnodes N --nproc G --node-rank R --master-addr ADDR` (several)."""
    if args.model:
        model = args.model
    elif args.hf_config:
        model = f"hf:{args.hf_config}"
    else:      # a shape given as numbers has no name `train` knows: the closest a user can run is an HF config
        model = "hf:CONFIG.json"
    parts = ["shardwise", "train", config_path, "--model", model]
    if args.seq_len is not None:
        parts += ["--seq-len", str(args.seq_len)]
    per_node = max(1, min(world_size, gpus_per_node))
    nodes = math.ceil(world_size / per_node)
    if nodes * per_node != world_size:          # torchrun needs equal nodes: the largest divisor that fits a node
        per_node = max(d for d in range(1, per_node + 1) if world_size % d == 0)
        nodes = world_size // per_node
    command = " ".join(shlex.quote(p) for p in parts)
    if nodes == 1:
        return f"{command} --nproc {per_node}"
    return f"{command} --nnodes {nodes} --nproc {per_node} --node-rank R --master-addr ADDR"


def run_it_line(args: argparse.Namespace, config_path: str, plan: Any, cluster: Any) -> str:
    command = train_command(args, config_path, plan.world_size, cluster.gpus_per_node)
    note = " on each node, R = 0, 1, ... and ADDR node 0's address" if "--nnodes" in command else ""
    if not (args.model or args.hf_config):
        note += " (the model was given as numbers: write it as a config.json)"
    return f"Wrote {config_path}: run it with `{command}`{note}"
