"""The phases of `scripts/gpu_check.sh`, one per process (`benchmarks.gpu_check` runs each with a timeout):

    python -m benchmarks.gpu_phases A --device cuda --out a.json

A  environment, device selection, and every collective on a world-1 group run through its backend (NCCL on a
   GPU) with the test switch SHARDWISE_COLLECTIVES_AT_WORLD_1, each checked and timed by the ledger's events.
B  fp32 exactness at world 1 (collectives real) of ZeRO 1-3 and offload against stage 0; fp16 with a forced
   overflow (the step skipped, the scale halved, the weights untouched); host reads per optimizer step (the
   engine's own calls, and on CUDA the synchronisations `torch.cuda.set_sync_debug_mode` sees).
C, D  in `benchmarks.gpu_scale`.

Each phase writes a list of checks {check, status, value, limit, detail}: status PASS / FAIL against the limit,
INFO for a figure without one (or one that only a GPU can judge), SKIP with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

PASS, FAIL, INFO, SKIP = "PASS", "FAIL", "INFO", "SKIP"


class Checks:
    """The rows a phase reports; `run` turns an exception into a FAIL row and goes on."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, check: str, status: str, value: Any = None, limit: str = "", detail: str = "") -> None:
        self.rows.append({"check": check, "status": status, "value": value, "limit": limit, "detail": detail})

    def bound(self, check: str, value: float, *, at_most: float | None = None, at_least: float | None = None,
              judge: bool = True, detail: str = "") -> None:
        """A figure against a limit: PASS/FAIL when `judge`, else INFO with the limit shown."""
        ok = (at_most is None or value <= at_most) and (at_least is None or value >= at_least)
        limit = " ".join(s for s in (f">= {at_least:g}" if at_least is not None else "",
                                     f"<= {at_most:g}" if at_most is not None else "") if s)
        self.add(check, (PASS if ok else FAIL) if judge else INFO, value, limit, detail)

    def run(self, check: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:     # noqa: BLE001 - one failed check must not hide the others
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            self.add(check, FAIL, None, "", f"{type(exc).__name__}: {str(exc)[:300]} "
                                            f"[{Path(frame.filename).name}:{frame.lineno}]")


def tiny_config(device: torch.device) -> Any:
    """The GPT of phases B and D: the test size on the CPU, a little wider on a GPU (still seconds)."""
    from shardwise.models import gpt_config
    if device.type == "cuda":
        return gpt_config("tiny", n_layer=2, d_model=128, n_head=4, seq_len=64, vocab_size=512)
    return gpt_config("tiny", n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=256)


def token_data(cfg: Any, rows: int, count: int, device: torch.device, seed: int = 7) -> list[tuple]:
    """`count` micro-batches (inputs [rows, s], labels [rows, s]) on `device`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        t = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=g)
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


def base_config(**extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 1 << 30, **extra}


# -- A --------------------------------------------------------------------------------------------

def phase_a(device: torch.device, checks: Checks) -> None:
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    from shardwise.comm.device import local_cuda_index, select_device
    from shardwise.engine.initialize import init_distributed
    from shardwise.telemetry.peak import device_peak_flops
    import torch.distributed as dist

    checks.add("A.torch", INFO, torch.__version__, "", f"python {platform.python_version()}, cuda "
                                                       f"{torch.version.cuda}, threads {torch.get_num_threads()}")
    chosen = select_device()
    checks.add("A.device", PASS if chosen.type == device.type else FAIL, str(chosen), device.type)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(chosen)
        checks.add("A.gpu", INFO, props.name, "", f"capability {props.major}.{props.minor}, "
                                                   f"{props.total_memory / 2**30:.0f} GiB, nccl "
                                                   f"{'.'.join(map(str, torch.cuda.nccl.version()))}")
        checks.add("A.device_index", PASS if chosen.index == local_cuda_index() == torch.cuda.current_device()
                   else FAIL, chosen.index, "LOCAL_RANK % GPUs, current")
        peak, source = device_peak_flops(chosen, torch.bfloat16)
        checks.add("A.peak_bf16_tflops", INFO, round(peak / 1e12, 1), "", source)
    init_distributed()
    backend = str(dist.get_backend())
    checks.add("A.backend", PASS if ("nccl" in backend) == (device.type == "cuda") else FAIL, backend)
    ledger = CommLedger()
    comm = Comm(None, ledger, name="check")
    checks.add("A.switch", PASS if not comm.local else FAIL, "world 1 communicates", "collectives run")
    x = torch.arange(1, 1 + 4096, dtype=torch.float32, device=chosen)

    def collective(name: str, fn: Callable[[], bool]) -> None:
        def body() -> None:
            before = len(ledger.records) + len(ledger._unresolved)
            ok = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(chosen)
            recorded = len(ledger.records) + len(ledger._unresolved) - before
            checks.add(f"A.{name}", PASS if ok and recorded >= 1 else FAIL, recorded, "result exact, recorded")
        checks.run(f"A.{name}", body)

    def all_reduce(dtype: torch.dtype, op: Any) -> bool:
        t = x.to(dtype).clone()
        comm.all_reduce(t, op=op)
        return torch.equal(t, x.to(dtype))

    collective("all_reduce_fp32", lambda: all_reduce(torch.float32, dist.ReduceOp.SUM))
    collective("all_reduce_bf16", lambda: all_reduce(torch.bfloat16, dist.ReduceOp.SUM))
    collective("all_reduce_max_int64", lambda: all_reduce(torch.int64, dist.ReduceOp.MAX))

    def host_metric() -> bool:      # a host tensor: staged on the GPU when the group has no CPU backend
        t = torch.tensor([3.0, 4.0], dtype=torch.float64)
        comm.all_reduce(t)
        return t.tolist() == [3.0, 4.0]

    collective("all_reduce_host_tensor", host_metric)

    def broadcast() -> bool:
        t = x.clone()
        comm.broadcast(t, src_group_rank=0)
        return torch.equal(t, x)

    def all_gather() -> bool:
        out = torch.empty_like(x)
        comm.all_gather_into_tensor(out, x)
        return torch.equal(out, x)

    def reduce_scatter() -> bool:
        out = torch.empty_like(x)
        comm.reduce_scatter_tensor(out, x)
        return torch.equal(out, x)

    def ring() -> bool:
        t = x.clone()
        comm.ring_all_reduce(t)
        return torch.equal(t, x)

    collective("broadcast", broadcast)
    collective("all_gather", all_gather)
    collective("reduce_scatter", reduce_scatter)
    collective("ring_all_reduce", ring)
    ledger.flush()
    seconds = sum(r.duration_s for r in ledger.records)
    checks.add("A.ledger_seconds", PASS if seconds > 0 else FAIL, f"{seconds * 1e3:.3f} ms", "> 0",
               "CUDA events" if device.type == "cuda" else "host clock")


# -- B --------------------------------------------------------------------------------------------

def _train(device: torch.device, extra: dict[str, Any], steps: int = 2) -> tuple[list[float], dict, Any]:
    import shardwise
    from shardwise.models import GPT
    cfg = tiny_config(device)
    torch.manual_seed(1234)
    model = GPT(cfg)
    engine, *_ = shardwise.initialize(model=model, config=base_config(**extra))
    data = iter(token_data(cfg, 2, 2 * steps, device))
    losses = [float(engine.train_batch(data)) for _ in range(steps)]
    state = {k: v.detach().float().cpu() for k, v in engine.consolidated_state_dict().items()}
    return losses, state, engine


def _max_rel(a: dict, b: dict) -> float:
    """The largest |a - b| / (atol + rtol |b|) at torch's fp32 tolerances (1e-5 each): <= 1 passes. The attention
    k_proj biases are left out: their true gradient is 0, and Adam turns rounding noise into lr-sized steps
    (the tests' rule, `shardwise.testing.assert_state_close`)."""
    return max(float(((a[k] - b[k]).abs() / (1e-5 + 1e-5 * b[k].abs())).max()) for k in b
               if not k.endswith("k_proj.bias"))


def phase_b(device: torch.device, checks: Checks) -> None:
    from shardwise.engine.initialize import init_distributed
    init_distributed()
    ref_losses, ref_state, engine = _train(device, {})
    engine.close()
    offload = {"device": "cpu", "pin_memory": True}
    cases = {"stage1": {"stage": 1}, "stage2": {"stage": 2}, "stage3": {"stage": 3},
             "stage2+offload_opt": {"stage": 2, "offload_optimizer": offload},
             "stage3+offload_opt+param": {"stage": 3, "offload_optimizer": offload, "offload_param": offload}}

    def exact(name: str, zero: dict) -> None:
        losses, state, engine = _train(device, {"zero_optimization": zero})
        engine.close()
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        checks.bound(f"B.fp32_{name}_loss_vs_stage0", loss_rel, at_most=1e-5)
        checks.bound(f"B.fp32_{name}_params_vs_stage0", _max_rel(state, ref_state), at_most=1.0,
                     detail="max |diff| / (1e-5 + 1e-5 |stage 0|) over the weights")

    for name, zero in cases.items():
        checks.run(f"B.fp32_{name}", lambda name=name, zero=zero: exact(name, zero))
    checks.run("B.fp16_forced_overflow", lambda: _forced_overflow(device, checks))
    checks.run("B.host_reads", lambda: _host_reads(device, checks))


def _forced_overflow(device: torch.device, checks: Checks) -> None:
    """fp16 with a loss scale of 2^40: the first step's gradients overflow; it is skipped on every rank, the scale
    halves (hysteresis 1), and the weights stay as they were."""
    import shardwise
    from shardwise.models import GPT
    cfg = tiny_config(device)
    torch.manual_seed(1234)
    model = GPT(cfg)
    fp16 = {"enabled": True, "initial_scale_power": 40, "hysteresis": 1, "loss_scale_window": 1000}
    engine, *_ = shardwise.initialize(model=model, config=base_config(fp16=fp16, zero_optimization={"stage": 2}))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = iter(token_data(cfg, 2, 2, device))
    engine.train_batch(data)
    unchanged = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    ok = engine.skipped_steps == 1 and engine.current_loss_scale == 2.0 ** 39 and unchanged
    checks.add("B.fp16_forced_overflow", PASS if ok else FAIL,
               f"skipped {engine.skipped_steps}, scale {engine.current_loss_scale:g}, weights kept {unchanged}",
               f"skipped 1, scale {2.0 ** 39:g}, weights kept")
    engine.close()


def _host_reads(device: torch.device, checks: Checks) -> None:
    """Per optimizer step: the engine's own host reads (HostReadCounter), and on CUDA every synchronisation the
    sync debug mode warns about (the model's and torch's too)."""
    import shardwise
    from shardwise.models import GPT
    from shardwise.testing import HostReadCounter
    cfg = tiny_config(device)
    for name, extra in {"stage0_bf16": {"bf16": {"enabled": True}},
                        "zero2_bf16": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}}.items():
        torch.manual_seed(1234)
        engine, *_ = shardwise.initialize(model=GPT(cfg), config=base_config(**extra))
        data = iter(token_data(cfg, 2, 6, device))
        engine.train_batch(data)                       # warm: lazy state, allocator
        with HostReadCounter() as counter:
            engine.train_batch(data)
        checks.bound(f"B.host_reads_{name}", len(counter.calls), at_most=1, detail=" ".join(w for _, w in counter.calls))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.train_batch(data)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
            checks.bound(f"B.cuda_syncs_{name}", len(syncs), at_most=1, detail="; ".join(syncs)[:300])
        engine.close()


PHASES: dict[str, Callable[[torch.device, Checks], None]] = {"A": phase_a, "B": phase_b}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_phases", description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=("A", "B", "C", "D"))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, required=True, help="JSON file of the phase's checks")
    args = p.parse_args(argv)
    os.environ["SHARDWISE_DEVICE"] = args.device
    if args.phase in ("A", "B"):
        os.environ["SHARDWISE_COLLECTIVES_AT_WORLD_1"] = "1"     # world 1 runs its collectives for real
    from shardwise.comm.device import select_device
    device = select_device()
    checks = Checks()
    if args.phase in PHASES:
        PHASES[args.phase](device, checks)
    else:
        from benchmarks.gpu_scale import PHASES as SCALE
        SCALE[args.phase](device, checks)
    args.out.write_text(json.dumps(checks.rows, indent=1, default=str))
    from shardwise.engine.initialize import exit_rank
    exit_rank(0)      # no interpreter finalization: gloo's threads may still hold work objects


if __name__ == "__main__":
    sys.exit(main())
