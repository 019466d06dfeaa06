"""What the benchmark modules share: argparse types (errors exit 2 with argparse's one line) and the
launcher command that starts a module on local ranks."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any, Callable, Sequence


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value
    return parse


def positive_float(what: str = "") -> Callable[[str], float]:
    """`what` names the quantity in the error, e.g. "sizes ... MiB"."""
    def parse(text: str) -> float:
        value = float(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{what + ' ' if what else ''}must be > 0, got {text}")
        return value
    return parse


def run_under_launcher(module: str, nproc: int, argv: Sequence[str], *, threads_per_rank: int | None = None) -> int:
    """Start `python -m module *argv` on `nproc` local ranks through torch's elastic launcher (standalone
    rendezvous); returns its exit code. `threads_per_rank` sets OMP_NUM_THREADS for the ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", module, *argv]
    env = None if threads_per_rank is None else {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank)}
    return subprocess.run(cmd, check=False, env=env).returncode


def run_in_gloo_group(run: Callable[[Any], None], args: Any) -> int:
    """Inside a launched rank: one torch thread (the ranks share the machine's cores), a gloo group, `run(args)`,
    then a barrier so no rank tears the group down while a peer still uses it. Returns the exit code 0."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        run(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
