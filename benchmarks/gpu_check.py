"""One command for the GPU path (`scripts/gpu_check.sh`): phases A-D, each in its own process with a timeout,
then one table CHECK / STATUS / VALUE / LIMIT and a JSON file.

    scripts/gpu_check.sh                          # on one GPU (H100/H200: under 6 minutes)
    scripts/gpu_check.sh --device cpu --json out.json    # every phase on the CPU: proves the script

A  environment and every collective on a world-1 group through the backend (NCCL on a GPU)
B  fp32 exactness of ZeRO 1-3 and offload at world 1 against stage 0; fp16 forced overflow; host syncs per step
C  the ~1B GPT in bf16: MFU against the spec peak, ZeRO and offload over stage 0, copy bandwidth, peak memory
   against the planner
D  2 ranks through gloo on one device: DP, ZeRO, TP against the single-process reference

A phase that crashes or runs past its timeout is one FAIL row (its process is killed); the others still run.
Exit code 0 when no row failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

# Seconds per phase: on a GPU (the whole run under 6 minutes) and on the CPU.
TIMEOUTS = {"cuda": {"A": 60, "B": 90, "C": 240, "D": 90}, "cpu": {"A": 120, "B": 240, "C": 240, "D": 300}}
PHASES = ("A", "B", "C", "D")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description="Check the GPU path: phases A-D.")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="(default: %(default)s)")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), help="(default: all)")
    p.add_argument("--json", type=Path, default=Path("gpu_check.json"), metavar="OUT",
                   help="where the rows go (default: %(default)s)")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every phase's timeout")
    return p


def run_phase(phase: str, device: str, timeout_s: float, workdir: Path) -> tuple[list[dict[str, Any]], float]:
    """The phase's rows, or one FAIL row saying why there are none; and its wall seconds."""
    out = workdir / f"{phase}.json"
    log = workdir / f"{phase}.log"
    cmd = [sys.executable, "-m", "benchmarks.gpu_phases", phase, "--device", device, "--out", str(out)]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)           # the phase and the ranks it spawned
            proc.wait()
            code = None
    seconds = time.perf_counter() - start
    if code is None:
        return [_row(f"{phase}.phase", "FAIL", f"{seconds:.0f} s", f"<= {timeout_s:.0f} s", "timed out")], seconds
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return [_row(f"{phase}.phase", "FAIL", f"exit {code}", "exit 0", tail[0][:300])], seconds
    return json.loads(out.read_text()), seconds


def _row(check: str, status: str, value: Any, limit: str, detail: str) -> dict[str, Any]:
    return {"check": check, "status": status, "value": value, "limit": limit, "detail": detail}


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4g}"
    return "-" if v is None else str(v)


def print_table(rows: list[dict[str, Any]]) -> None:
    widths = [max(len(h), *(len(c) for c in col)) for h, col in
              zip(("CHECK", "STATUS", "VALUE", "LIMIT"),
                  zip(*[(r["check"], r["status"], _value(r["value"]), r["limit"]) for r in rows] or [("",) * 4]))]
    print("  ".join(h.ljust(w) for h, w in zip(("CHECK", "STATUS", "VALUE", "LIMIT"), widths)) + "  DETAIL")
    for r in rows:
        cells = (r["check"], r["status"], _value(r["value"]), r["limit"])
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)) + f"  {r['detail']}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows: list[dict[str, Any]] = []
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for phase in args.phases:
            timeout = TIMEOUTS[args.device][phase] * args.timeout_scale
            print(f"[gpu_check] phase {phase} (timeout {timeout:.0f} s) ...", file=sys.stderr, flush=True)
            got, seconds[phase] = run_phase(phase, args.device, timeout, Path(tmp))
            rows += got
    print_table(rows)
    failed = [r["check"] for r in rows if r["status"] == "FAIL"]
    summary = {"device": args.device, "phases": args.phases, "seconds": seconds, "failed": failed, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1, default=str))
    print(f"[gpu_check] {len(rows)} checks, {len(failed)} failed, "
          f"{sum(seconds.values()):.0f} s -> {args.json}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
