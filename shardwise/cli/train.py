"""`shardwise train`: validate in this process, then launch the ranks with torch's elastic launcher.

Everything that can be the user's fault (flags, the config file and its batch arithmetic, the model
preset, the corpus) is checked here, BEFORE any rank starts, and reported as one line with exit code 2.
A mistake found by N ranks after start-up would otherwise print N tracebacks through the launcher.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.cli import run_dir
from shardwise.cli.rendezvous import DEFAULT_RENDEZVOUS_TIMEOUT_S, meet_other_nodes
from shardwise.errors import UserError

DEFAULT_SEED = 0
DEFAULT_STEPS_PER_PRINT = 10
DEFAULT_MASTER_PORT = 29500
_held: list[Any] = []       # the run directory's lock, held while the ranks run


def default_config(steps: int) -> dict[str, Any]:
    """The DeepSpeed config used when no CONFIG is given: AdamW at 1e-3 after a linear warm-up over
    the first tenth of the run (at least one step, at most 100), clipped gradients, fp32."""
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                      "warmup_num_steps": max(1, min(100, steps // 10)),
                                                      "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "steps_per_print": DEFAULT_STEPS_PER_PRINT,
    }


@dataclass(frozen=True, kw_only=True)
class WorkerArgs:
    """Everything a rank needs, resolved by the parent; serialised to RUN_DIR as JSON. The ranks run
    `shardwise.cli.train_worker` with this file, which doubles as the record of what the run did and names the run
    a later command may resume."""

    config: dict[str, Any]        # the DeepSpeed config dict (from CONFIG or `default_config`)
    model: str                    # preset name, as given
    seq_len: int
    data: str                     # corpus spec
    steps: int
    seed: int
    out: str                      # run directory (absolute)
    peak_tflops: float | None     # per rank; None: measure a matmul on each rank
    save_every: int               # 0: never save a checkpoint
    steps_per_print: int
    pipeline_trace: bool = False  # draw the last step's measured pipeline timeline (needs pipeline.stages > 1)
    launch: str = ""              # this command's name for RUN_DIR/logs/LAUNCH, where failed ranks report
    vocab_size: int | None = None  # --vocab-size (the resolved model is RUN_DIR/model.json)
    eval_every: int = 0           # evaluate on the held-out split every N steps (0: never)
    eval_batches: int = 0         # micro-batches per rank of each evaluation
    train_batch_size: int | None = None   # sequences per step over all ranks (a resumed run says when it changes)

    def write(self, path: Path) -> Path:
        # Written to a temporary name and renamed: two nodes on one host may share RUN_DIR.
        from shardwise.checkpoint.files import atomic_write_text
        atomic_write_text(path, json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> "WorkerArgs":
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))


# -- argument parsing -------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train", help="train a model preset or a Hugging Face model on a corpus with N ranks (torchrun under the hood)",
        description="Train a model with the shardwise engine. Validates the config, model and corpus, "
                    "then launches the ranks with torch's elastic launcher. Writes RUN_DIR/metrics.jsonl "
                    "(one line per step), RUN_DIR/summary.json, RUN_DIR/loss.png and RUN_DIR/model.json.")
    p.add_argument("config", nargs="?", default=None, metavar="CONFIG.json",
                   help="DeepSpeed-style JSON config; without it: micro-batch 8, no accumulation, AdamW lr 1e-3 "
                        "with WarmupLR, gradient clipping 1.0")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this node (default: 1)")
    p.add_argument("--model", default="tiny",
                   help="a preset (tiny, small, gpt2-124m, gpt3-1.3b, llama-tiny, llama-7b, gpt-moe-tiny, "
                        "llama-moe-tiny, ...; a wrong name lists them all) or hf:PATH, a Hugging Face config.json or "
                        "save_pretrained directory (default: tiny)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the vocabulary of token-id data (.npy, memmap): ids must be below it (default: the model's)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="every N steps, evaluate on a held-out split (the corpus's last 5%%, never trained on) and "
                        "log eval loss and perplexity (0: no evaluation, the whole corpus trains)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="micro-batches per rank in each evaluation (default: 4)")
    p.add_argument("--data", default="stdlib",
                   help="corpus spec: 'stdlib', a text file, a directory, 'memmap:PATH:uint16' or a .npy file "
                        "(default: stdlib)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    p.add_argument("--out", default=None, metavar="RUN_DIR", help="run directory (default: runs/MODEL-TIME)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help="seed of the model init and the data order (default: 0)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of one rank for MFU (default: a matmul measured once per machine and "
                        "dtype, kept in ~/.cache/shardwise or $SHARDWISE_CACHE_DIR)")
    p.add_argument("--timeout", type=float, default=None, metavar="MIN",
                   help="minutes a collective may wait for the other ranks before every rank reports where it is "
                        "and the run ends naming the ranks that did not arrive (default: the config's "
                        "communication.timeout_minutes, else 5)")
    p.add_argument("--context-parallel", type=int, default=None, metavar="C",
                   help="split every sequence over C ranks (context parallelism; the config's "
                        "\"context_parallel\": {\"size\": C}); the data-parallel size becomes nproc / (C * tp * pp)")
    p.add_argument("--cp-impl", choices=("ring", "ulysses"), default=None,
                   help="with --context-parallel: ring attention (default) or Ulysses (heads divisible by C)")
    p.add_argument("--expert-parallel", type=int, default=None, metavar="E",
                   help="split each MoE layer's experts over E data-parallel ranks (expert parallelism; the config's "
                        "\"expert_parallel\": {\"size\": E}); E divides the data-parallel size, a model with MoE "
                        "layers (gpt-moe-tiny, llama-moe-tiny, ...)")
    p.add_argument("--pipeline-trace", action="store_true",
                   help="with pipeline.stages > 1: write RUN_DIR/pipeline_timeline.png and pipeline_trace.json, the "
                        "measured per-stage timeline of the last step, and print its bubble fraction")
    p.add_argument("--save-every", type=int, default=0,
                   help="save a checkpoint to RUN_DIR/checkpoints every N steps and at the end (0: never)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in RUN_DIR from its latest checkpoint (automatic when RUN_DIR holds "
                        "checkpoints of the same run); an error when there is none")
    p.add_argument("--resume-from", default=None, metavar="TAG",
                   help="continue the run in RUN_DIR from checkpoint TAG (e.g. global_step200) instead of the one "
                        "`latest` names, when that one is damaged; later metrics rows are set aside")
    p.add_argument("--overwrite", action="store_true",
                   help="RUN_DIR holds another run (or this run without a checkpoint): delete its metrics, "
                        "checkpoints, summary and plots and start again")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the ranks up to N times after one fails; they resume from the latest "
                        "checkpoint, losing at most --save-every steps (default: 0)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="number of nodes, one `shardwise train` per node (default: 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1 (default: 0)")
    p.add_argument("--master-addr", default=None, help="address of node 0 (required with --nnodes > 1)")
    p.add_argument("--master-port", type=int, default=None,
                   help=f"port of the rendezvous store on node 0 (default: {DEFAULT_MASTER_PORT} with "
                        "--nnodes > 1, a free port on one node)")
    p.add_argument("--rendezvous-timeout", type=float, default=DEFAULT_RENDEZVOUS_TIMEOUT_S, metavar="SECONDS",
                   help="with --nnodes > 1: how long the nodes wait for each other before giving up "
                        f"(default: {DEFAULT_RENDEZVOUS_TIMEOUT_S:g})")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Validate, write the worker arguments, run torch's elastic launcher and return the run's exit code.

    A run directory that holds a run is resumed, or refused, before anything in it changes (`run_dir`). The
    launcher (torchrun's agent) then runs in this process (`launch`): it starts the local ranks, runs the
    rendezvous across nodes, restarts the ranks after a failure (`--max-restarts`), forwards SIGTERM and SIGINT
    to them, and tears the group down; its outcome becomes a few lines and the exit code.

    OMP_NUM_THREADS is set to this node's cores // local ranks unless the caller already set it (the ranks
    inherit this process's environment)."""
    try:
        worker_args, args_path = prepare(args)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(args.nproc)))
        # torch's C++ warnings are off in the ranks: a lost peer or store makes every rank's store client log
        # an 18-line C++ trace; the ranks' own reports say what happened (TORCH_CPP_LOG_LEVEL=INFO shows them).
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        # A hang's verdict is printed once, by the launcher (`rank_reports.failure_lines`): not every rank's report.
        from shardwise.comm.watchdog import QUIET_ENV
        os.environ.setdefault(QUIET_ENV, "1")
        print(f"shardwise train: {args.nnodes * args.nproc} rank(s), model {worker_args.model}, "
              f"data {worker_args.data}, {worker_args.steps} steps -> {worker_args.out}", flush=True)
        from shardwise.cli.launch import launch
        from shardwise.cli.train_worker import reports_folder

        meet_other_nodes(args, DEFAULT_MASTER_PORT)
        return launch(launcher_command(args, args_path)[3:], reports=reports_folder(worker_args),
                      run_dir=Path(worker_args.out))
    finally:
        while _held:
            _held.pop().close()


def threads_per_rank(local_ranks: int) -> int:
    """Cores this process may use, split evenly over the local ranks (at least one each), so that
    N ranks of intra-op threads do not oversubscribe the cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:    # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


def launcher_command(args: argparse.Namespace, args_path: Path) -> list[str]:
    """The torchrun command line for this node (`shardwise train` runs it in-process: `launch`).

    Single node: `--standalone` rendezvous on a free port. Several nodes: static rendezvous, where
    `--node-rank 0` hosts the store at `--master-addr:--master-port` and its local rank 0 is global rank 0,
    so the run directory of node 0 receives metrics.jsonl, loss.png and summary.json.
    """
    from shardwise.cli.launch import stop_grace_args

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--nnodes", str(args.nnodes), "--max-restarts", str(args.max_restarts), *stop_grace_args()]
    if args.nnodes == 1 and args.master_port is None:
        cmd += ["--standalone"]
    else:
        cmd += ["--rdzv-backend", "static", "--node-rank", str(args.node_rank),
                "--master-addr", args.master_addr or "127.0.0.1",
                "--master-port", str(args.master_port or DEFAULT_MASTER_PORT)]
    return cmd + ["-m", "shardwise.cli.train_worker", str(args_path)]


# -- validation -------------------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> tuple[WorkerArgs, Path]:
    """Check every user input, decide how RUN_DIR is used (start, resume, refuse: `run_dir.decide`), create it
    and write the worker arguments; UserError on a mistake."""
    _check_flags(args)
    _check_gpus(args.nproc)
    world_size = args.nproc * args.nnodes
    raw_config = _read_config(args.config, args.steps)
    if getattr(args, "timeout", None) is not None:     # the flag wins over the config, in the config the ranks get
        communication = raw_config.get("communication")
        raw_config["communication"] = {**(communication if isinstance(communication, dict) else {}),
                                       "timeout_minutes": args.timeout}
    _apply_context_parallel_flags(raw_config, args)
    _apply_expert_parallel_flag(raw_config, args)
    engine_config = _check_config(raw_config, args.config, world_size)
    if args.pipeline_trace and engine_config.pipeline.stages < 2:
        raise UserError(f"--pipeline-trace needs a pipeline: the config has pipeline.stages = "
                        f"{engine_config.pipeline.stages}; add \"pipeline\": {{\"stages\": 2}} (or more) to it")
    model_cfg = _check_model(args.model, args.seq_len, args.vocab_size)
    _check_expert_parallel(engine_config, model_cfg, args.model)
    _check_context_parallel(engine_config, model_cfg)
    _check_corpus(args.data, model_cfg.seq_len, model_cfg.vocab_size)
    _check_micro_batch_fits(int(engine_config.batch.micro_batch), model_cfg.seq_len, args.nproc)
    if model_cfg.is_hf and engine_config.pipeline.stages > 1:
        raise UserError(f"--model {args.model}: pipeline.stages = {engine_config.pipeline.stages} needs a model "
                        f"shardwise can split into stages (a preset such as llama-tiny, or a PipelineModule); "
                        f"train a Hugging Face model with data, ZeRO and tensor parallelism")

    label = Path(args.model.removeprefix("hf:")).name if model_cfg.is_hf else args.model
    out = Path(args.out) if args.out else Path("runs") / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} exists and is not a directory; choose another run directory.")
    steps_per_print = engine_config.steps_per_print or DEFAULT_STEPS_PER_PRINT   # DeepSpeed's default: None
    worker_args = WorkerArgs(config=raw_config, model=args.model, seq_len=model_cfg.seq_len, data=args.data,
                             steps=args.steps, seed=args.seed, out=str(out.resolve()),
                             peak_tflops=args.peak_tflops, save_every=args.save_every,
                             steps_per_print=int(steps_per_print), pipeline_trace=args.pipeline_trace,
                             vocab_size=args.vocab_size, eval_every=args.eval_every,
                             eval_batches=args.eval_batches,
                             train_batch_size=int(engine_config.batch.train_batch_size),
                             launch=f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    name = "train_args.json" if args.nnodes == 1 else f"train_args.node{args.node_rank}.json"

    # Start, resume or refuse, before anything in RUN_DIR changes; under its lock when it exists already.
    def decide() -> run_dir.Decision:
        from shardwise.cli.resume import schedule_note, tag_problem
        return run_dir.decide(out, name, dataclasses.asdict(worker_args), resume=args.resume,
                              overwrite=args.overwrite, schedule_note=schedule_note,
                              resume_from=getattr(args, "resume_from", None), tag_problem=tag_problem)

    existed = out.is_dir()
    decision = decide() if not existed else None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {str(out)!r}: cannot create the run directory ({e.strerror}).") from None
    _held.append(run_dir.lock(out, f".{Path(name).stem}.lock"))
    decision = decision or decide()
    for line in (decision.message, *decision.notes):
        if line:
            print(f"shardwise train: {line}", flush=True)
    from shardwise.models.registry import MODEL_FILE
    model_cfg.write(out / MODEL_FILE)
    return worker_args, worker_args.write(out / name)


def _apply_context_parallel_flags(raw_config: dict[str, Any], args: argparse.Namespace) -> None:
    """--context-parallel / --cp-impl win over the config's "context_parallel" block, in the config the ranks get."""
    size, impl = getattr(args, "context_parallel", None), getattr(args, "cp_impl", None)
    if size is None and impl is None:
        return
    if size is not None and size < 1:
        raise UserError(f"--context-parallel {size}: must be at least 1 (the ranks one sequence is split over).")
    block = raw_config.get("context_parallel")
    block = dict(block) if isinstance(block, dict) else {}
    if size is not None:
        block["size"] = size
    if impl is not None:
        block["impl"] = impl
    raw_config["context_parallel"] = block


def _apply_expert_parallel_flag(raw_config: dict[str, Any], args: argparse.Namespace) -> None:
    """--expert-parallel wins over the config's "expert_parallel" block (its AutoEP spelling too)."""
    size = getattr(args, "expert_parallel", None)
    if size is None:
        return
    if size < 1:
        raise UserError(f"--expert-parallel {size}: must be at least 1 (the ranks one MoE layer's experts are "
                        f"split over).")
    block = raw_config.get("expert_parallel")
    block = {k: v for k, v in block.items() if k not in ("size", "autoep_size", "enabled")} \
        if isinstance(block, dict) else {}
    raw_config["expert_parallel"] = {**block, "size": size}


def _check_expert_parallel(engine_config: Any, model_cfg: Any, spec: str) -> None:
    """A preset without experts, or whose experts ep does not divide: one line before any launch (a Hugging
    Face model is checked by each rank's initialize)."""
    ep = engine_config.expert_parallel.size
    if ep == 1 or model_cfg.is_hf:
        return
    experts = model_cfg.gpt_config().moe_experts
    if not experts:
        from shardwise.models.presets import MOE_PRESETS
        raise UserError(f"--model {spec}: expert_parallel.size = {ep} needs a model with MoE layers; use an MoE "
                        f"preset ({', '.join(MOE_PRESETS)}) or expert_parallel.size 1")
    if experts % ep:
        raise UserError(f"--model {spec}: its {experts} experts per layer do not split over expert_parallel.size = "
                        f"{ep}; choose a size dividing {experts}")


def _check_context_parallel(engine_config: Any, model_cfg: Any) -> None:
    """A preset whose sequence or heads do not split over context_parallel.size: one line before any launch (a
    Hugging Face model is checked by each rank's initialize, which reports one line too)."""
    section = engine_config.context_parallel
    if section.size == 1 or model_cfg.is_hf:
        return
    from shardwise.parallel.context import check_context_parallel
    gpt, tp = model_cfg.gpt_config(), engine_config.tensor_parallel.size
    kv_heads = gpt.n_kv_head or gpt.n_head
    check_context_parallel(section, heads=max(gpt.n_head // tp, 1), kv_heads=max(kv_heads // tp, 1),
                           seq_len=gpt.seq_len, attention_dropout=gpt.dropout)


def _check_flags(args: argparse.Namespace) -> None:
    positive = {"--nproc": args.nproc, "--steps": args.steps, "--nnodes": args.nnodes}
    if args.seq_len is not None:
        positive["--seq-len"] = args.seq_len
    for flag, value in positive.items():
        if value < 1:
            raise UserError(f"{flag} {value}: must be at least 1.")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise UserError(f"--vocab-size {args.vocab_size}: must be at least 1 (the number of token ids).")
    if args.eval_every and args.eval_batches < 1:
        raise UserError(f"--eval-batches {args.eval_batches}: must be at least 1 with --eval-every.")
    for flag, value in {"--seed": args.seed, "--save-every": args.save_every,
                        "--eval-every": args.eval_every,
                        "--max-restarts": args.max_restarts}.items():
        if value < 0:
            raise UserError(f"{flag} {value}: must be 0 or more.")
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not 0 < timeout < 1e6:
        raise UserError(f"--timeout {timeout}: must be a positive number of minutes (e.g. 5, or 0.5 for 30 s).")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise UserError(f"--peak-tflops {args.peak_tflops}: must be a positive number of TFLOP/s per rank "
                        f"(or leave it out to measure it).")
    if not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"--node-rank {args.node_rank}: must be in 0..{args.nnodes - 1} "
                        f"for --nnodes {args.nnodes}.")
    if not args.rendezvous_timeout > 0:
        raise UserError(f"--rendezvous-timeout {args.rendezvous_timeout}: must be a positive number of seconds.")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise UserError(f"--master-port {args.master_port}: must be a TCP port in 1..65535.")
    if args.max_restarts > 0 and args.nnodes > 1:
        raise UserError(f"--max-restarts {args.max_restarts} with --nnodes {args.nnodes}: restarts need every node's "
                        f"agent to meet again (a c10d rendezvous), which this launcher does not set up; restart "
                        f"a multi-node run by running the same commands again (they resume).")
    if args.nnodes > 1 and args.master_addr is None:
        raise UserError(f"--nnodes {args.nnodes} needs --master-addr: the address of the node started with "
                        f"--node-rank 0 (127.0.0.1 when every node runs on this host).")


def _node_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):    # not POSIX
        return None


def _check_micro_batch_fits(micro_batch: int, seq_len: int, nproc: int) -> None:
    """Refuse a micro-batch whose token ids alone (int64 [micro_batch, seq_len + 1], drawn on the host by every
    local rank) exceed this node's memory: a lower bound of what a step needs, so nothing that could run is
    refused, and a typo such as 1e9 is one line instead of every rank's MemoryError."""
    total = _node_memory_bytes()
    need = micro_batch * (seq_len + 1) * 8 * nproc
    if total is not None and need > total:
        raise UserError(f"train_micro_batch_size_per_gpu {micro_batch}: one micro-batch of token ids is "
                        f"{need / nproc / 2**30:.3g} GiB per rank (x{nproc} rank(s) at --seq-len {seq_len}), beyond "
                        f"this node's {total / 2**30:.3g} GiB of memory; lower it (or raise "
                        f"gradient_accumulation_steps for the same global batch)")


def _check_gpus(nproc: int) -> None:
    """On a GPU node every local rank needs a GPU of its own: more ranks than GPUs would share them (NCCL refuses two
    ranks of one communicator on one GPU). SHARDWISE_DEVICE=cpu runs the ranks on the CPU instead."""
    import torch

    from shardwise.comm.device import DEVICE_ENV, uses_cuda

    if not uses_cuda():
        return
    gpus = torch.cuda.device_count()
    if nproc > gpus:
        raise UserError(f"--nproc {nproc}: this node has {gpus} visible GPU(s) and each rank needs its own; use "
                        f"--nproc {gpus} or fewer, make more GPUs visible (CUDA_VISIBLE_DEVICES), or set "
                        f"{DEVICE_ENV}=cpu to train on the CPU.")


def _read_config(path: str | None, steps: int) -> dict[str, Any]:
    """The raw config dict: CONFIG read as JSON (ConfigError names the file), or the default one."""
    if path is None:
        return default_config(steps)
    from shardwise.config import read_config

    return read_config(path)


def _check_config(raw: dict[str, Any], path: str | None, world_size: int) -> Any:
    """Validate the config and its batch arithmetic for `world_size` ranks; returns the EngineConfig."""
    from shardwise.cli.config_warnings import printed_config_warnings
    from shardwise.config import ConfigError, load_config_for_world

    try:
        with printed_config_warnings():
            return load_config_for_world(copy.deepcopy(raw), world_size=world_size)
    except ConfigError as e:
        where = f"config file {path!r}" if path else "default config"
        # One line per problem, each saying where it comes from.
        raise UserError("\n".join(f"{where} with {world_size} rank(s): {line}" for line in str(e).splitlines())) \
            from None


def _check_model(name: str, seq_len: int | None, vocab_size: int | None = None) -> Any:
    """The resolved `--model` (a `ModelChoice`: preset or Hugging Face), or a one-line UserError."""
    from shardwise.models.registry import resolve_model

    return resolve_model(name, seq_len=seq_len, vocab_size=vocab_size)


def _check_corpus(spec: str, seq_len: int, vocab_size: int) -> None:
    """The corpus exists, is readable and has at least one window of seq_len + 1 tokens, all < vocab_size.

    Byte-level corpora read from a tree (stdlib, directories, globs) are checked on a prefix just long enough
    for one window: their ids are bytes, so the vocab check needs no pass over the data, and the
    ranks read the whole tree anyway. Files and memmaps are checked whole (memmaps are not read into RAM).
    """
    from shardwise.data import ByteTokenizer, CorpusError, CorpusKind, check_length, load_corpus, parse_spec

    try:
        kind = parse_spec(spec).kind
        if kind in (CorpusKind.STDLIB, CorpusKind.DIRECTORY, CorpusKind.TEXT_FILE, CorpusKind.GLOB):
            if vocab_size < ByteTokenizer.vocab_size:
                raise CorpusError(f"corpus {spec!r} is byte-level text (ids 0..255) but the model's vocab_size "
                                  f"is {vocab_size}; use --vocab-size 256 (or more), or a preset with "
                                  f"vocab_size >= 256.")
            prefix = seq_len + 1 if kind is not CorpusKind.TEXT_FILE else None
            tokens = load_corpus(spec, max_bytes=prefix)
        else:
            tokens = load_corpus(spec, vocab_size=vocab_size)
        check_length(tokens, seq_len)
    except CorpusError as e:
        raise UserError(f"--data {spec!r}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    """Exception text on one line: a ConfigError has one line per problem, joined here with '; '."""
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
