"""`shardwise plan`: FLOPs, memory, communication and the fastest parallel plan for a model on a cluster.

    shardwise plan --model llama-7b --cluster h100-80gb --gpus 16 --global-batch 512
    shardwise plan --hf-config config.json --cluster a100-80gb --gpus 64 --json
    shardwise plan --model tiny --calibrate cluster.json --gpus 2 --global-batch 8    # measure this machine
    shardwise plan --model gpt2-124m --cluster cluster.json --dp 2 --zero 0            # evaluate one plan
    shardwise plan --model 1.3b --gpus 8 --write-config ds_config.json                 # the winner, for train
    shardwise plan --model llama-7b --seq 131072 --gpus 8 --global-batch 8           # long context: cp

Nothing here imports torch (the planner is pure arithmetic), so it answers in well under a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
from typing import Any

from shardwise.errors import UserError

_PLAN_FLAGS = ("dp", "tp", "pp", "cp", "cp_impl", "ep", "zero", "offload", "micro_batch", "recompute", "schedule",
               "virtual_stages", "sequence_parallel")


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value
    return parse


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from shardwise.planner.presets import CLUSTER_PRESETS, MODEL_PRESETS
    from shardwise.config import PipelineSchedule
    from shardwise.config.schema import ContextParallelImpl
    from shardwise.planner.specs import Offload, Optimizer, Precision, Recompute, Zero3Gather

    p = subparsers.add_parser("plan", help="estimate FLOPs, memory, communication and the best parallel plan",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (a preset, a Hugging Face config.json, or the shape as numbers)")
    g.add_argument("--model", metavar="NAME", help=f"preset: {', '.join(MODEL_PRESETS)}")
    g.add_argument("--hf-config", metavar="CONFIG.json", help="a Hugging Face config.json (gpt2, llama, mistral)")
    for flag, what in (("--layers", "transformer blocks"), ("--hidden", "d_model"), ("--heads", "attention heads"),
                       ("--kv-heads", "key/value heads (grouped-query attention; default: --heads)"),
                       ("--ffn", "MLP width d_ff (default 4 x hidden, or Llama's 8/3 rule for swiglu)"),
                       ("--vocab", "vocabulary size"),
                       ("--seq", "context length (with --model or --hf-config: that model at this context)")):
        g.add_argument(flag, type=_positive(int), metavar="N", help=what)
    g.add_argument("--ffn-kind", choices=["gelu", "swiglu"], default="gelu",
                   help="gelu: GPT MLP with biases, LayerNorm, learned positions; swiglu: Llama (RMSNorm, "
                        "rotary, no biases)")

    g = p.add_argument_group("cluster (a preset, a JSON file, or a measurement of this machine)")
    g.add_argument("--cluster", default="a100-80gb", metavar="NAME|FILE.json",
                   help=f"preset ({', '.join(CLUSTER_PRESETS)}; default %(default)s) or a cluster JSON file")
    g.add_argument("--calibrate", metavar="OUT.json",
                   help="measure this machine (torch matmul, attention, pointwise and optimizer kernels, gloo "
                        "collectives; --gpus CPU processes at once play the GPUs), save it to OUT.json and plan "
                        "on it; `python -m benchmarks.planner_check`, run in a clone of the repository, compares "
                        "its step times with the engine's")
    g.add_argument("--calibrate-threads", type=_positive(int), default=1, metavar="N",
                   help="torch threads per rank while calibrating (default %(default)s)")
    g.add_argument("--calibrate-rounds", type=_positive(int), default=3, metavar="N",
                   help="rounds of every probe; each figure is the median (default %(default)s)")
    g.add_argument("--gpus", type=_positive(int), metavar="N", help="GPUs in total (default: the preset's 8)")
    g.add_argument("--gpus-per-node", type=_positive(int), metavar="N")
    g.add_argument("--gpu-memory-gb", type=_positive(float), metavar="GB")
    g.add_argument("--peak-tflops", type=_positive(float), metavar="TF", help="dense 16-bit peak per GPU")
    g.add_argument("--intra-bw-gbs", type=_positive(float), metavar="GB/s", help="per GPU, one direction")
    g.add_argument("--inter-bw-gbs", type=_positive(float), metavar="GB/s", help="per GPU, one direction")
    g.add_argument("--intra-latency-us", type=_positive(float), metavar="US")
    g.add_argument("--inter-latency-us", type=_positive(float), metavar="US")
    g.add_argument("--efficiency", type=_positive(float), metavar="F",
                   help="fraction of the peak a large GEMM sustains, the ceiling of the shape model (A100 preset "
                        "0.77, fitted on published runs; calibrated 1.0)")

    g = p.add_argument_group("training job")
    g.add_argument("--global-batch", type=_positive(int), default=512, metavar="B",
                   help="sequences per optimizer step (default %(default)s)")
    g.add_argument("--tokens", type=_positive(float), metavar="T", help="training tokens (default 20 per parameter)")
    g.add_argument("--seq-len", type=_positive(int), metavar="S", help="default: the model's context")
    g.add_argument("--precision", choices=[x.value for x in Precision], default="bf16")
    g.add_argument("--optimizer", choices=[x.value for x in Optimizer], default="adam")
    g.add_argument("--causal-flops", action="store_true", help="halve attention-score FLOPs for the causal mask")
    g.add_argument("--flash-attention", action="store_true", help="attention scores are not kept in memory")
    g.add_argument("--no-overlap", action="store_true", help="gradient communication does not overlap backward")
    g.add_argument("--pp-scatter-gather", action="store_true",
                   help="pipeline sends carry 1/tp of each activation, all-gathered over NVLink (Megatron)")
    g.add_argument("--zero3-gather", choices=[x.value for x in Zero3Gather], default="block",
                   help="ZeRO-3 gathers a block at a time (our engine) or each module (DeepSpeed); default %(default)s")
    g.add_argument("--zero3-prefetch", type=int, default=50_000_000, metavar="N",
                   help="ZeRO-3 parameters gathered ahead of the compute (stage3_prefetch_bucket_size; "
                        "default %(default)s, 0: none)")

    g = p.add_argument_group("evaluate one plan instead of searching (unset sizes: dp = GPUs / (tp * pp * cp))")
    g.add_argument("--dp", type=_positive(int))
    g.add_argument("--tp", type=_positive(int))
    g.add_argument("--pp", type=_positive(int))
    g.add_argument("--cp", type=_positive(int), help="context-parallel ranks sharing each sequence")
    g.add_argument("--cp-impl", choices=[x.value for x in ContextParallelImpl],
                   help="context-parallel attention (default ring)")
    g.add_argument("--ep", type=_positive(int), help="expert-parallel ranks splitting each MoE block's experts "
                                                      "(divides dp)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    g.add_argument("--offload", choices=[x.value for x in Offload])
    g.add_argument("--micro-batch", type=_positive(int))
    g.add_argument("--recompute", choices=[x.value for x in Recompute])
    g.add_argument("--schedule", choices=[x.value for x in PipelineSchedule])
    g.add_argument("--virtual-stages", type=_positive(int))
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="split layer-norm/dropout activations over the TP group (default: on when tp > 1)")

    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print every figure as JSON")
    g.add_argument("--plot", metavar="OUT.png", help="write a memory-breakdown chart")
    g.add_argument("--write-config", metavar="OUT.json", help="write the chosen plan as a DeepSpeed-style config")
    p.set_defaults(func=run)
    return p


def _model(args: argparse.Namespace) -> Any:
    from shardwise.models.presets import GPTConfig
    from shardwise.planner.hf import model_from_hf_config
    from shardwise.planner.presets import MODEL_PRESETS, model_preset
    from shardwise.planner.specs import PlannerError

    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")}
    named = bool(args.model or args.hf_config)     # --seq alone then sets the named model's context length
    given = [name for name, on in (("--model", args.model), ("--hf-config", args.hf_config),
                                   ("the shape (--layers ...)", any(v is not None for k, v in shape.items()
                                                                    if not (named and k == "seq")))) if on]
    if len(given) != 1:
        raise UserError(f"give exactly one model: --model NAME ({', '.join(MODEL_PRESETS)}), --hf-config "
                        f"CONFIG.json, or --layers/--hidden/--heads/--vocab/--seq; got "
                        f"{' and '.join(given) if given else 'none'}")
    if named:
        model = model_preset(args.model) if args.model else model_from_hf_config(args.hf_config)
        return model if args.seq is None else dataclasses.replace(model, seq_len=args.seq)
    missing = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab", "seq") if shape[k] is None]
    if missing:
        raise UserError(f"a model given as numbers needs {', '.join(missing)} as well")
    llama = args.ffn_kind == "swiglu"
    try:   # GPT-2's dropout rate for the GELU shape: the planner counts dropout's masks, not its rate
        return GPTConfig(n_layer=args.layers, d_model=args.hidden, n_head=args.heads, n_kv_head=args.kv_heads,
                         d_ff=args.ffn, vocab_size=args.vocab, seq_len=args.seq, mlp=args.ffn_kind,
                         norm="rmsnorm" if llama else "layernorm", positions="rotary" if llama else "learned",
                         bias=not llama, tie_embeddings=not llama, dropout=0.0 if llama else 0.1)
    except ValueError as e:
        raise PlannerError(f"the model given as numbers: {e}") from None


_CLUSTER_FLAGS = (  # flag -> ClusterSpec field, unit
    ("gpus", "num_gpus", 1), ("gpus_per_node", "gpus_per_node", 1), ("gpu_memory_gb", "memory_bytes", 1e9),
    ("intra_bw_gbs", "intra_node_bw", 1e9), ("inter_bw_gbs", "inter_node_bw", 1e9),
    ("intra_latency_us", "intra_node_latency_s", 1e-6), ("inter_latency_us", "inter_node_latency_s", 1e-6),
    ("efficiency", "compute_efficiency", 1),
)


def _cluster(args: argparse.Namespace) -> Any:
    from shardwise.planner.calibrate import calibrate, load_cluster, save_cluster
    from shardwise.planner.presets import cluster_preset

    if args.calibrate:
        cluster = calibrate(ranks=args.gpus, threads=args.calibrate_threads, rounds=args.calibrate_rounds)
        save_cluster(cluster, args.calibrate)
    elif args.cluster.endswith(".json") or os.path.sep in args.cluster:
        cluster = load_cluster(args.cluster)
    else:
        cluster = cluster_preset(args.cluster)
    changes: dict[str, Any] = {}
    for flag, field, scale in _CLUSTER_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            changes[field] = value * scale if scale != 1 else value
    if args.peak_tflops is not None:
        changes["peak_flops_bf16"] = args.peak_tflops * 1e12
    if "num_gpus" in changes and "gpus_per_node" not in changes:
        changes["gpus_per_node"] = min(cluster.gpus_per_node, changes["num_gpus"])
    return cluster.replace(**changes) if changes else cluster


def _plan(args: argparse.Namespace, num_gpus: int) -> Any:
    from shardwise.config import PipelineSchedule
    from shardwise.config.schema import ContextParallelImpl
    from shardwise.planner.specs import Offload, PlannerError, Plan, Recompute

    if all(getattr(args, k) is None for k in _PLAN_FLAGS):
        return None
    tp, pp, cp = args.tp or 1, args.pp or 1, args.cp or 1
    dp = args.dp or num_gpus // (tp * pp * cp)
    if dp < 1:
        raise PlannerError(f"--tp {tp} x --pp {pp} x --cp {cp} = {tp * pp * cp} is more than the {num_gpus} GPUs")
    interleaved = PipelineSchedule.INTERLEAVED_1F1B
    schedule = (PipelineSchedule(args.schedule) if args.schedule
                else interleaved if (args.virtual_stages or 1) > 1 else PipelineSchedule.ONE_F_ONE_B)
    return Plan(dp=dp, tp=tp, pp=pp, cp=cp, cp_impl=ContextParallelImpl(args.cp_impl or "ring"),
                zero_stage=args.zero or 0, offload=Offload(args.offload or "none"),
                micro_batch=args.micro_batch or 1, recompute=Recompute(args.recompute or "none"), schedule=schedule,
                virtual_stages=args.virtual_stages or (2 if schedule is interleaved else 1),
                sequence_parallel=args.sequence_parallel if args.sequence_parallel is not None else tp > 1,
                ep=args.ep or 1)


def run(args: argparse.Namespace) -> int:
    from shardwise.planner.analysis import analyze
    from shardwise.planner.export import write_config
    from shardwise.planner.report import plot, render, to_json
    from shardwise.planner.specs import JobSpec, PlannerError

    model = _model(args)
    cluster = _cluster(args)
    job = JobSpec(global_batch=args.global_batch, tokens=args.tokens, seq_len=args.seq_len, precision=args.precision,
                  optimizer=args.optimizer, causal_flops=args.causal_flops, flash_attention=args.flash_attention,
                  overlap_dp_comm=not args.no_overlap, pp_scatter_gather=args.pp_scatter_gather,
                  zero3_gather=args.zero3_gather, zero3_prefetch_elements=args.zero3_prefetch)
    analysis = analyze(model, cluster, job, _plan(args, cluster.num_gpus))
    written, written_plan = None, None
    if args.write_config:
        chosen = analysis.chosen
        if chosen is None or not chosen.feasible:
            why = "; ".join(p.detail for p in chosen.problems) if chosen is not None else "no plan fits"
            raise PlannerError(f"--write-config: there is no runnable plan to write ({why})")
        written, written_plan = write_config(args.write_config, chosen.plan, job), chosen.plan
    if args.plot:
        plot(analysis, args.plot)
    if args.json:
        out = to_json(analysis)
        out["written_config"] = written
        print(json.dumps(out, indent=2))
    else:
        from rich.console import Console
        console = Console()
        if not console.is_terminal:      # piped: do not squeeze the tables into 80 columns
            console = Console(width=160)
        render(analysis, console)
        if written_plan is not None:
            console.print(run_it_line(args, args.write_config, written_plan, cluster), markup=False, highlight=False)
        if args.plot:
            console.print(f"Wrote {args.plot}")
    return 0


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
    seq = args.seq_len if args.seq_len is not None else args.seq if args.model or args.hf_config else None
    if seq is not None:
        parts += ["--seq-len", str(seq)]
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
