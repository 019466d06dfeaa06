"""`shardwise check-config CONFIG.json --world N`: validate a config and show how it resolves.

Prints the batch triple with its arithmetic, dtypes and loss scaling, the optimizer and schedule
(as the torch objects they become), ZeRO, communication and parallel sizes; as a table or, with
--json, as JSON. Hugging Face "auto" values are filled as its Trainer fills them, each from the flag named after
the Trainer's argument (--micro-batch, --grad-accum, --lr, --betas, --eps, --weight-decay, --warmup-steps,
--total-steps, --max-grad-norm, --precision) or the model's --hidden-size. Any problem exits 2 with one line per
problem naming the key; keys accepted but ignored print one "shardwise: warning:" line each on stderr.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardwise.cli.config_warnings import printed_config_warnings
from shardwise.config import AutoValues, EngineConfig, load_config_for_world


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {value}")
    return value


def _beta(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "check-config", help="validate a DeepSpeed-style JSON config and show how it resolves",
        description="Validate a DeepSpeed-style JSON config and print what shardwise makes of it: the batch "
                    "triple with its arithmetic, precision and loss scaling, optimizer, scheduler, ZeRO and "
                    "communication settings. Exits 2 on any problem.")
    parser.add_argument("config", metavar="CONFIG.json", help="the config file")
    parser.add_argument("--world", type=_positive_int, default=1, metavar="N",
                        help="total number of processes of the run (default 1); the data-parallel size is "
                             "N / (tensor_parallel.size * pipeline.stages)")
    parser.add_argument("--hidden-size", type=_positive_int, metavar="H",
                        help='the model\'s hidden size, to fill "auto" ZeRO bucket sizes (h*h, 0.9*h*h, 10*h)')
    parser.add_argument("--micro-batch", type=_positive_int, metavar="B",
                        help='the micro-batch size per process, to fill "auto" batch keys')
    parser.add_argument("--grad-accum", type=_positive_int, metavar="N",
                        help='gradient accumulation steps, to fill "auto" gradient_accumulation_steps (default: '
                             'derived by the batch rule)')
    parser.add_argument("--lr", type=_positive_float, metavar="LR",
                        help='the learning rate, to fill "auto" in optimizer.params.lr and '
                             'scheduler.params.warmup_max_lr')
    parser.add_argument("--betas", type=_beta, nargs=2, metavar=("B1", "B2"),
                        help='Adam\'s betas, to fill "auto" optimizer.params.betas (default 0.9 0.999)')
    parser.add_argument("--eps", type=_positive_float, metavar="EPS",
                        help='Adam\'s epsilon, to fill "auto" optimizer.params.eps (default 1e-8)')
    parser.add_argument("--weight-decay", type=_non_negative_float, metavar="WD",
                        help='to fill "auto" optimizer.params.weight_decay (default 0)')
    parser.add_argument("--warmup-steps", type=_non_negative_int, metavar="N",
                        help='to fill "auto" scheduler.params.warmup_num_steps')
    parser.add_argument("--total-steps", type=_positive_int, metavar="N",
                        help='the run\'s optimizer steps, to fill "auto" scheduler.params.total_num_steps')
    parser.add_argument("--max-grad-norm", type=_non_negative_float, metavar="NORM",
                        help='to fill "auto" gradient_clipping (default 1.0; 0 = off)')
    parser.add_argument("--precision", choices=("fp16", "bf16", "fp32"),
                        help='to fill "auto" fp16.enabled / bf16.enabled (default: both false)')
    parser.add_argument("--json", action="store_true", help="print the resolved config as JSON")
    parser.set_defaults(func=run)
    return parser


def _loss_scaling(cfg: EngineConfig) -> str:
    p = cfg.precision
    if p.dynamic_loss_scale:
        return (f"dynamic: starts at 2^{p.initial_scale_power}, x2 after {p.loss_scale_window} clean steps, "
                f"/2 after {p.hysteresis} overflow(s), min {p.min_loss_scale:g}"
                + (", consecutive hysteresis" if p.consecutive_hysteresis else ""))
    if p.static_loss_scale != 1.0:
        return f"static: {p.static_loss_scale:g}"
    return "none"


def _rows(cfg: EngineConfig, world: int, optimizer_text: str | None) -> list[tuple[str, str]]:
    b, z, tp, pp, cp = cfg.batch, cfg.zero, cfg.tensor_parallel, cfg.pipeline, cfg.context_parallel
    derived = f" (derived: {', '.join(b.derived)})" if b.derived else ""
    offload = ", ".join(name for name, on in (("optimizer", z.offloads_optimizer), ("params", z.offloads_params)) if on)
    sched = cfg.scheduler
    return [
        ("data-parallel size", f"{b.dp_size} = world {world} / (tensor_parallel {tp.size} * pipeline {pp.stages}"
                               + (f" * context_parallel {cp.size} {cp.impl.value}" if cp.size > 1 else "") + ")"),
        ("batch", b.arithmetic() + derived),
        ("dtype", f"{cfg.precision.dtype.value}"
                  + (" (fp16 auto_cast)" if cfg.precision.auto_cast and cfg.precision.dtype.value == "fp16" else "")),
        ("loss scaling", _loss_scaling(cfg)),
        ("gradient clipping", f"{cfg.gradient_clipping:g}" if cfg.gradient_clipping > 0 else "off"),
        ("optimizer", optimizer_text or "none in config (pass one to shardwise.initialize)"),
        ("scheduler", f"{sched.type}({', '.join(f'{k}={v!r}' for k, v in sched.params.items())})" if sched else "none"),
        ("ZeRO", f"stage {z.stage}, reduce_bucket_size {z.reduce_bucket_size:,}, overlap_comm "
                 f"{str(z.overlap_comm).lower()}" + (f", offload {offload}" if offload else "")),
        ("all-reduce", f"{cfg.communication.all_reduce.value}"
                       + (f", in {cfg.communication.data_type.value}" if cfg.communication.data_type else "")
                       + (f", predivide by {cfg.gradient_predivide_factor:g}"
                          if cfg.gradient_predivide_factor != 1.0 else "")),
        ("tensor parallel", f"{tp.size}" + (" + sequence parallel" if tp.sequence_parallel else "")),
        ("pipeline", f"{pp.stages} stage(s), {pp.schedule.value}, {pp.virtual_stages} virtual, {pp.partition.value}"),
        ("recompute", cfg.activation_checkpointing.policy.value),
        ("run guards", _guards(cfg)),
        ("monitoring", _monitoring(cfg)),
    ]


def _guards(cfg: EngineConfig) -> str:
    """Collective timeout, desync check, and what happens to inf/nan steps."""
    from shardwise.engine.skips import consecutive_limit, skips_nonfinite_steps
    c, limit = cfg.communication, consecutive_limit(cfg)
    skips = "inf/nan steps skipped" if skips_nonfinite_steps(cfg) else "inf/nan steps applied (not skipped)"
    stop = f", the run stops after {limit} in a row" if limit else ", never stops for them"
    return (f"collective timeout {c.timeout_minutes:g} min, desync check {'on' if c.desync_check else 'off'}, "
            f"{skips}{stop}")


def _monitoring(cfg: EngineConfig) -> str:
    """What global rank 0 will log and print, or "none"."""
    m = cfg.monitors
    parts = [f"{name} -> {block.log_dir}" for name, block in (("tensorboard", m.tensorboard),
                                                            ("csv_monitor", m.csv_monitor)) if block.enabled]
    if m.wandb.enabled:
        parts.append(f"wandb project {m.wandb.project}")
    if m.steps_per_print:
        parts.append(f"progress every {m.steps_per_print} steps")
    parts += [name for name, on in (("wall_clock_breakdown", m.wall_clock_breakdown),
                                    ("comms_logger", m.comms_logger.enabled)) if on]
    if m.flops_profiler.enabled:
        parts.append(f"flops_profiler at step {m.flops_profiler.profile_step}")
    return ", ".join(parts) or "none"


def run(args: argparse.Namespace) -> int:
    known = AutoValues(hidden_size=args.hidden_size, micro_batch=args.micro_batch,
                       gradient_accumulation_steps=args.grad_accum, lr=args.lr,
                       betas=tuple(args.betas) if args.betas else None, eps=args.eps, weight_decay=args.weight_decay,
                       warmup_num_steps=args.warmup_steps, total_num_steps=args.total_steps,
                       gradient_clipping=args.max_grad_norm, precision=args.precision)
    with printed_config_warnings():
        cfg = load_config_for_world(args.config, world_size=args.world, auto=known)
    # Imported here: building the optimizer/scheduler needs torch, the config check itself does not.
    from shardwise.engine.optim import check_specs

    choice = check_specs(cfg.optimizer, cfg.scheduler)
    optimizer_text = f"{cfg.optimizer.type} -> {choice.describe()}" if cfg.optimizer and choice else None
    if args.json:
        described = cfg.describe()
        described["world_size"] = args.world
        if described["optimizer"] is not None and choice is not None:
            described["optimizer"]["torch"] = choice.describe()
        print(json.dumps(described, indent=2, sort_keys=False))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.config} on {args.world} process(es)", show_header=True, header_style="bold")
    table.add_column("setting", style="cyan", no_wrap=True)
    table.add_column("resolved")
    for name, value in _rows(cfg, args.world, optimizer_text):
        table.add_row(name, value)
    Console(soft_wrap=False).print(table)
    return 0
