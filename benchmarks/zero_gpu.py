"""ZeRO stages 0-3 and CPU offload on ONE device (world size 1): step time, peak memory, offload copy bandwidth.

    python -m benchmarks.zero_gpu --device cuda --model 1b --json zero_gpu.json
    python -m benchmarks.zero_gpu --device cpu --model tiny --steps 2 --warmup 1 --seq 32 --micro-batch 2

One process, one short run (GPU machines are lent for minutes): each row builds the GPT afresh from one seed on the
device, wraps it with `shardwise.initialize` (bf16, AdamW, clipping 1.0, no accumulation), runs warm-up then timed
steps on the same 4 random micro-batches (synchronized around each step), and is freed before the next. Rows: stage
0 (the plain engine: the baseline, run again after stage 3 to show drift), stages 1-3, stage 2 + offload_optimizer,
stage 3 + offload_optimizer + offload_param (CPU, pinned). At world size 1 every collective is a local copy, so the
overhead over stage 0 is ZeRO's own bookkeeping (flat buckets, shard masters, copies). The target for stages 1
and 2 is a step time at most 1.05x stage 0's: sharding that saves nothing at world size 1 should cost next to
nothing. A row that fails (OOM, error) records its error and the run goes on.

The bandwidth section times, on [N] buffers (N: the fp32 gradient shard, i.e. every parameter at world size 1), a
plain pinned copy (fp32 device <-> pinned fp32 host) against the copies ZeRO-Offload makes (parallel/zero/copies.py):
the bf16 device grad shard into a pinned bf16 host buffer, cast on the host into the fp32 gradient buffer kept across
steps, and the fp32 master cast on the host into pinned bf16, copied to the device. The JSON is rewritten after every
row and section.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import args_meta, int_at_least, positive_float, sequence_length, write_json
from benchmarks.trainers import token_batches

GIB = 1 << 30
TARGET = 1.05                   # the most step time stages 1-2 may take over stage 0 at world size 1
TARGET_ROWS = ("stage1", "stage2")


@dataclass(frozen=True)
class RowSpec:
    name: str
    stage: int
    offload_optimizer: bool = False
    offload_param: bool = False

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer or self.offload_param


# stage0_repeat: the baseline again; its ratio shows drift (a few % makes the 5% verdict inconclusive)
ROWS = (RowSpec("stage0", 0), RowSpec("stage1", 1), RowSpec("stage2", 2), RowSpec("stage3", 3),
        RowSpec("stage0_repeat", 0), RowSpec("stage2+offload_opt", 2, offload_optimizer=True),
        RowSpec("stage3+offload_opt+param", 3, offload_optimizer=True, offload_param=True))


def model_config(name: str) -> Any:
    """"1b": the 1.3b preset cut to 18 layers and 1024 positions, vocab padded to 50304 (a multiple of 128):
    1,011,572,736 parameters (tied embeddings). "tiny": the test preset."""
    from shardwise.models import gpt_config
    if name == "1b":
        return gpt_config("1.3b", n_layer=18, seq_len=1024, vocab_size=50304)
    return gpt_config("tiny")


# -- arguments ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.zero_gpu",
                                description="ZeRO stages 0-3 and CPU offload at world size 1 on one device.")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="(default: %(default)s)")
    p.add_argument("--model", choices=("1b", "tiny"), default="1b", help="GPT size (default: %(default)s)")
    p.add_argument("--steps", type=int_at_least(1), default=20, help="timed steps per row (default: %(default)s)")
    p.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--offload-steps", type=int_at_least(1), default=3,
                   help="timed steps of the offload rows, at most --steps, after at most 1 warm-up step: their "
                        "steps take seconds on a 1B model (default: %(default)s)")
    p.add_argument("--seq", type=int_at_least(1), default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--micro-batch", type=int_at_least(1), default=None,
                   help="sequences per step (default: 8 for 1b, 4 for tiny)")
    p.add_argument("--rows", nargs="+", choices=[r.name for r in ROWS], default=None, metavar="ROW",
                   help=f"run only these rows, of {', '.join(r.name for r in ROWS)} (default: all; the overhead "
                        f"column needs stage0)")
    p.add_argument("--row-budget-s", type=positive_float(), default=60.0,
                   help="stop a row's timed steps (at least one) past this (default: %(default)s)")
    p.add_argument("--bandwidth-reps", type=int_at_least(1), default=5, help="(default: %(default)s)")
    p.add_argument("--bandwidth-numel", type=int_at_least(1), default=None,
                   help="elements of the copy buffers (default: the model's parameters: its grad shard)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results to OUT")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and check; a bad value exits 2 with one line. Fills in seq, micro_batch and rows."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; run on a GPU machine "
                     f"with a CUDA build of torch, or use --device cpu")
    args.seq = sequence_length(parser, args.seq, model_config(args.model).seq_len, flag="--seq", model=args.model)
    if args.micro_batch is None:
        args.micro_batch = 8 if args.model == "1b" else 4
    args.rows = [r.name for r in ROWS] if args.rows is None else args.rows
    return args


def ds_config(spec: RowSpec, micro_batch: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": spec.stage}
    if spec.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if spec.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": zero,
            "steps_per_print": 1 << 30}


# -- device helpers -----------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()                           # hooks and engines form reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
        # Freed pinned buffers stay page-locked in torch's host cache, each rounded up to a power of two (a 4.05 GB
        # fp32 buffer holds 8 GiB): give them back, or the rows after the bandwidth section pin twice as much.
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def _error(exc: BaseException) -> str:
    """One line: the exception and the innermost frame (file:line) it came from."""
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" [{Path(frame.filename).name}:{frame.lineno}]" if frame else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400] + where


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   device_memory_bytes=props.total_memory, nccl=str(torch.cuda.nccl.version()))
    return env


# -- one row ------------------------------------------------------------------------------------------

def _timed_row(spec: RowSpec, args: argparse.Namespace, device: torch.device, data: list, out: dict) -> None:
    """Build, warm up and time one row, filling `out` as it goes (so a failure keeps what was measured).
    Everything it allocates is local: it is freed when this returns or raises."""
    import shardwise
    from shardwise.models import GPT
    t0 = time.perf_counter()
    torch.manual_seed(1234)
    with torch.device(device):             # built where it runs: no host init and copy of 4 GB of fp32 weights
        model = GPT(model_config(args.model))
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(spec, args.micro_batch))
    try:
        _sync(device)
        out["build_s"] = time.perf_counter() - t0
        if device.type == "cuda":          # the build's peak (fp32 weights + their bf16 copy) apart from training's
            out["cuda_build_peak_bytes"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        if spec.offloads:                  # page-locked? (else a non_blocking copy is a synchronous one)
            opt = engine.updater
            flats = opt.runtime.partition.flats if spec.offload_param else []
            out["pinned"] = {"masters": all(m.is_pinned() for m in opt.masters),
                             "param_shards": all(f.shard.is_pinned() for f in flats) if flats else None}
        step = 0

        def one_step() -> torch.Tensor:
            nonlocal step
            loss = engine(data[step % len(data)])
            engine.backward(loss)
            engine.step()
            step += 1
            return loss.detach()

        losses = [one_step() for _ in range(min(args.warmup, 1) if spec.offloads else args.warmup)]
        out["warmup_steps"] = len(losses)
        _sync(device)
        steps = min(args.steps, args.offload_steps) if spec.offloads else args.steps
        times, start = [], time.perf_counter()
        out["step_s"] = times              # filled in place: a step that raises keeps the ones before it
        for _ in range(steps):
            t = time.perf_counter()
            losses.append(one_step())
            _sync(device)                  # the step's kernels and copies are done: wall time is the step time
            times.append(time.perf_counter() - t)
            if time.perf_counter() - start > args.row_budget_s:
                break                      # device time is scarce: keep what we have
        out["losses"] = [float(x) for x in losses]      # every step, warm-up included: rows compare per step
        out["memory_report"] = engine.memory_report()
        if device.type == "cuda":
            out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    finally:
        engine.close()


def run_row(spec: RowSpec, args: argparse.Namespace, device: torch.device, data: list) -> dict[str, Any]:
    row: dict[str, Any] = {"row": spec.name, **asdict(spec), "offloads": spec.offloads, "error": None}
    _release(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        row["allocated_before_bytes"] = torch.cuda.memory_allocated(device)
    try:
        _timed_row(spec, args, device, data, row)
    except Exception as exc:               # OOM included: record it and go on with the next row
        row["error"] = _error(exc)
        print(f"[zero_gpu] {spec.name} failed: {row['error']}", file=sys.stderr, flush=True)
    _release(device)
    if device.type == "cuda":              # left behind by the row (a leak would inflate the next rows' peaks)
        row["allocated_after_bytes"] = torch.cuda.memory_allocated(device)
    ms = [t * 1e3 for t in row.get("step_s") or []]
    row.update(steps_timed=len(ms), median_ms=statistics.median(ms) if ms else None, min_ms=min(ms, default=None),
               max_ms=max(ms, default=None))
    row["tokens_per_s"] = args.micro_batch * args.seq / row["median_ms"] * 1e3 if ms else None
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Step-time ratio of each row over stage 0 (the plain engine: the median of every stage0 and stage0_repeat
    step); pass/fail against TARGET for stages 1-2."""
    pooled = [t for r in rows if r["stage"] == 0 and not r["offloads"] for t in r.get("step_s") or []]
    base = statistics.median(pooled) * 1e3 if pooled else None
    for r in rows:
        r["vs_stage0"] = r["median_ms"] / base if base and r["median_ms"] else None
        if r["row"] in TARGET_ROWS:
            r["meets_target"] = None if r["vs_stage0"] is None else r["vs_stage0"] <= TARGET


# -- offload copy bandwidth ---------------------------------------------------------------------------

def _timed_s(fn: Callable[[], Any], device: torch.device) -> float:
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def _median_s(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    _timed_s(fn, device)                   # warm: first touch of host pages, allocator pools
    return statistics.median(_timed_s(fn, device) for _ in range(reps))


def bandwidth(numel: int, device: torch.device, reps: int) -> dict[str, Any]:
    """Plain pinned copies against the copies ZeRO-Offload makes, on [numel] buffers. Each figure: median seconds
    over `reps` and GB/s of the fp32 side (4 * numel bytes; ZeRO-Offload moves bf16 over the bus and casts on the
    host, so its figure counts the host cast too). On CPU "device" tensors are host tensors too and nothing is pinned: plain memcpy."""
    pin = device.type == "cuda"
    dev32 = torch.randn(numel, device=device)                      # [N] fp32 on the device
    dev16 = dev32.to(torch.bfloat16)                               # [N] the bf16 grad shard
    host32 = torch.empty(numel, pin_memory=pin).copy_(dev32)       # [N] pinned fp32: a plain copy's target
    master = torch.nn.Parameter(torch.empty(numel, pin_memory=pin).copy_(dev32))   # make_shard_masters' master
    # ShardedUpdate._load_grads's host gradient buffer: allocated once, pinned like the master, kept across steps
    grad_buf = torch.empty(master.shape, dtype=master.dtype, pin_memory=master.is_pinned())
    # The pinned bf16 buffers of parallel/zero/copies.py: the gradient shard's landing place, the master's cast
    host16_grad = torch.empty(numel, dtype=torch.bfloat16, pin_memory=pin)
    host16_param = torch.empty(numel, dtype=torch.bfloat16, pin_memory=pin)

    def d2h_then_host_cast() -> None:
        host16_grad.copy_(dev16, non_blocking=True)
        _sync(device)                              # the step waits for the bucket's event, then casts on the host
        grad_buf.copy_(host16_grad)

    def host_cast_then_h2d() -> torch.Tensor:
        host16_param.copy_(master.detach())        # fp32 -> bf16 on the host
        return host16_param.to(device, non_blocking=True, copy=True)

    out: dict[str, Any] = {"numel": numel, "bytes_fp32": 4 * numel, "reps": reps, "host_pinned": host32.is_pinned(),
                           "master_pinned": master.is_pinned(), "grad_buffer_pinned": grad_buf.is_pinned()}
    cases: dict[str, Callable[[], Any]] = {
        "plain_d2h": lambda: host32.copy_(dev32, non_blocking=True),
        "plain_h2d": lambda: dev32.copy_(host32, non_blocking=True),
        # the bf16 grad shard to a pinned bf16 host buffer (during backward), cast on the host into the fp32 buffer
        "zero_offload_d2h": d2h_then_host_cast,
        # ShardedUpdate._host_to_device: the fp32 master cast on the host into pinned bf16, then to the device
        "zero_offload_h2d": host_cast_then_h2d,
    }
    for name, fn in cases.items():
        out[name] = {"median_s": (sec := _median_s(fn, device, reps)), "gb_per_s": 4 * numel / sec / 1e9}
    out["d2h_ratio"] = out["zero_offload_d2h"]["median_s"] / out["plain_d2h"]["median_s"]
    out["h2d_ratio"] = out["zero_offload_h2d"]["median_s"] / out["plain_h2d"]["median_s"]
    return out


# -- report -------------------------------------------------------------------------------------------

def _fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    cfg = result["config"]
    table = Table(title=f"ZeRO at world size 1 on {result['environment'].get('device_name', cfg['device'])}: "
                        f"{cfg['model']} GPT ({cfg['params']:,} params), bf16, micro-batch {cfg['micro_batch']} x "
                        f"{cfg['seq']} tokens")
    # loss@1: the loss of step 1 (0-based, warm-up included), after one update: the same in every row
    cols = ("row", "median ms", "min-max ms", "steps", "tokens/s", "vs stage0", f"<= {TARGET}", "peak GiB",
            "params/grads/optim GiB", "build s", "loss@1", "error")
    for c in cols:
        table.add_column(c, justify="left" if c in ("row", "error") else "right", overflow="fold")
    for r in result["rows"]:
        rep, losses, peak = r.get("memory_report") or {}, r.get("losses") or [], r.get("cuda_peak_bytes")
        states = "/".join(_fmt(rep[k] / GIB, ".2f") for k in ("params", "grads", "optimizer")) if rep else "-"
        verdict = {True: "pass", False: "FAIL", None: "-"}[r.get("meets_target")] if r["row"] in TARGET_ROWS else ""
        table.add_row(r["row"], _fmt(r["median_ms"]), f"{_fmt(r['min_ms'])}-{_fmt(r['max_ms'])}", str(r["steps_timed"]),
                      _fmt(r["tokens_per_s"], ",.0f"), _fmt(r["vs_stage0"], ".3f"), verdict,
                      _fmt(peak and peak / GIB, ".2f"), states, _fmt(r.get("build_s")),
                      _fmt(losses[1] if len(losses) > 1 else None, ".4f"), r["error"] or "")
    console = Console() if sys.stdout.isatty() else Console(width=220)
    console.print(table)
    bw = result.get("bandwidth") or {"error": "not run"}
    if "error" in bw:
        console.print(f"Bandwidth section: {bw['error']}")
        return
    line = ", ".join(f"{k} {bw[k]['gb_per_s']:.1f}" for k in ("plain_d2h", "zero_offload_d2h", "plain_h2d",
                                                               "zero_offload_h2d"))
    pinned = ", ".join(f"{k.removesuffix('_pinned')} {bw[k]}" for k in ("host_pinned", "master_pinned",
                                                                     "grad_buffer_pinned"))
    console.print(f"Offload copies of {bw['numel']:,} fp32 elements, GB/s (median of {bw['reps']}): {line}; time "
                  f"zero/plain: D2H {bw['d2h_ratio']:.2f}, H2D {bw['h2d_ratio']:.2f}. Pinned: {pinned}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from shardwise.models import gpt_flops_per_token, gpt_num_params
    from shardwise.comm.device import select_device
    os.environ.setdefault("SHARDWISE_DEVICE", args.device)
    device = select_device()
    cfg = model_config(args.model)
    params = gpt_num_params(cfg)
    data = [tuple(t.to(device) for t in b)
            for b in token_batches(args.micro_batch, args.seq, cfg.vocab_size, seed=100)]
    flops_per_token = gpt_flops_per_token(dataclasses.replace(cfg, seq_len=args.seq))
    result: dict[str, Any] = {
        "config": args_meta(args) | {
            "params": params, "world_size": 1, "flops_per_token": flops_per_token,
            "ds_config_stage0": ds_config(ROWS[0], args.micro_batch)},
        "environment": environment(device), "rows": [], "bandwidth": None}
    wanted = [r for r in ROWS if r.name in args.rows]
    # The in-device rows first (ROWS order), then the copy bandwidth, then the offload rows that depend on it.
    for spec in [r for r in wanted if not r.offloads] + [None] + [r for r in wanted if r.offloads]:
        if spec is None:
            _release(device)
            try:
                result["bandwidth"] = bandwidth(args.bandwidth_numel or params, device, args.bandwidth_reps)
            except Exception as exc:
                result["bandwidth"] = {"error": _error(exc)}
        else:
            print(f"[zero_gpu] {spec.name} ...", file=sys.stderr, flush=True)
            row = run_row(spec, args, device, data)
            row["model_tflops"] = flops_per_token * row["tokens_per_s"] / 1e12 if row["tokens_per_s"] else None
            result["rows"].append(row)
            add_ratios(result["rows"])
        if args.json is not None:          # after every row and section: a killed run keeps what it measured
            write_json(args.json, result)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Single process (a world of one); under torch.distributed.run only with --nproc-per-node 1."""
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        print(f"error: zero_gpu runs at world size 1 (WORLD_SIZE={os.environ['WORLD_SIZE']}): start it with plain "
              f"python, or --nproc-per-node 1", file=sys.stderr)
        return 2
    from shardwise.engine.initialize import init_distributed
    os.environ["SHARDWISE_DEVICE"] = args.device       # the engine trains where --device says (shardwise.comm.device)
    created = not dist.is_initialized()
    # Not under torchrun: a world of one on an in-memory store (no port, nothing left behind).
    init_distributed("nccl" if args.device == "cuda" else "gloo")
    try:
        result = run(args)
    finally:
        if created:
            dist.destroy_process_group()
    print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
