"""`shardwise bench {cp,dp,allreduce,fsdp,guards,moe,pipeline,pipeline_engines,recompute,tp} --nproc N
[OPTIONS...]`: run a side-by-side benchmark on N local ranks.

Each benchmark lives in `benchmarks.<name>` at the repository root (it is not part of the installed package, as
it imports dev-only peers) and is started through torch's elastic launcher; the options after the benchmark name
are that module's own (see `shardwise bench dp --nproc 2 --help`). Needs a clone of the repository installed with
`pip install -e '.[dev]'`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

import shardwise
from shardwise.errors import UserError

BENCHMARKS = {
    "cp": "context parallelism (ring, Ulysses) vs cp 1, all-gathered keys/values and DeepSpeed's Ulysses: step time, "
          "stored activations, longest sequence in a memory budget",
    "dp": "shardwise vs torch DDP (stage 0), DeepSpeed (stages 0-3, --offload) and FSDP2 (stage 3): step time, ratios, memory",
    "allreduce": "shardwise ring all-reduce vs the backend's all_reduce: bus bandwidth for 1-256 MB",
    "pipeline": "shardwise PipelineRuntime vs torch.distributed.pipelining: step time per schedule, bubble",
    "pipeline_engines": "shardwise engine.train_batch vs DeepSpeed's PipelineEngine (1F1B): step time",
    "guards": "the per-step desync check and the fp32 non-finite skip: step time with and without them",
    "recompute": "activation recomputation policies (none, selective, full, every_n): stored bytes, step time",
    "tp": "shardwise tensor parallelism vs torch DTensor parallelize_module: step time, ratios, memory",
    "fsdp": "shardwise fully_shard / DistributedDataParallel vs torch FSDP2 / DDP, plain loops: step time, memory",
    "moe": "shardwise's MoE layer vs DeepSpeed's at ep = nproc: step time, all-to-all bytes against the formula",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="side-by-side benchmarks against the peers",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(BENCHMARKS), help="; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()))
    p.add_argument("--nproc", type=int, default=2, help="local ranks (default: %(default)s)")
    p.add_argument("options", nargs=argparse.REMAINDER, help="passed to the benchmark module")
    p.set_defaults(func=run)


def _take_nproc(options: list[str], default: int) -> tuple[int, list[str]]:
    """`--nproc` may come after the benchmark name, where argparse's REMAINDER has swallowed it."""
    nproc, rest, i = default, [], 0
    while i < len(options):
        o = options[i]
        if o == "--nproc" and i + 1 < len(options):
            value, i = options[i + 1], i + 2
        elif o.startswith("--nproc="):
            value, i = o.split("=", 1)[1], i + 1
        else:
            rest.append(o)
            i += 1
            continue
        try:
            nproc = int(value)
        except ValueError:
            raise UserError(f"--nproc = {value!r}: give a whole number of ranks, e.g. --nproc 2") from None
    return nproc, rest


def _repo_root() -> Path:
    """Where a source checkout keeps `benchmarks/`: the folder above the `shardwise` package."""
    return Path(shardwise.__file__).resolve().parents[1]


def _benchmark_module(name: str) -> ModuleType:
    """`benchmarks.<name>` from the checkout this package runs from. Its root goes first on sys.path (unless
    there already) so a working directory elsewhere, or another `benchmarks` module installed, does not hide it."""
    root = _repo_root()
    if not (root / "benchmarks" / "__init__.py").is_file():
        raise UserError(f"bench {name}: the benchmarks are not part of the installed package (no benchmarks/ in "
                        f"{root}): run it from a clone of the repository installed with pip install -e '.[dev]' "
                        f"(the dev extra brings the peers DeepSpeed and transformers)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"benchmarks.{name}")


def run(args: argparse.Namespace) -> int:
    args.nproc, args.options = _take_nproc(list(args.options), args.nproc)
    if args.nproc < 1:
        raise UserError(f"--nproc = {args.nproc}: needs at least 1 rank")
    module = _benchmark_module(args.name)
    options = [o for o in args.options if o != "--"]
    if "-h" in options or "--help" in options:
        module.build_parser().print_help()
        return 0
    try:
        return module.launch(args.nproc, options)
    except ValueError as error:
        raise UserError(f"bench {args.name}: {error}") from None
    except SystemExit as error:      # the module's argparse rejected an option (it printed why)
        if not error.code:
            return 0
        raise UserError(f"bench {args.name}: invalid options {options} (see the usage above)") from None
