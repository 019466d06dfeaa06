"""What `shardwise train` tells its user: the pipeline trace of a tp x pp run, the peak FLOP/s reused from
the cache by the next run, MFU within 100%, and no warnings that carry nothing for the user."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shardwise.telemetry import read_metrics
from shardwise.telemetry.metrics import format_rate

TRAIN = [sys.executable, "-m", "shardwise.cli.main", "train"]
_OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3}}
# Lines torch or torchrun print that tell the user nothing they can act on.
NOISE = ("FutureWarning", "is deprecated", "OMP_NUM_THREADS environment variable", "*****", "Traceback")


def _run(tmp_path: Path, name: str, config: dict, *flags: str, cache: Path) -> subprocess.CompletedProcess:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDWISE_CACHE_DIR": str(cache)}
    proc = subprocess.run(TRAIN + [str(path), "--model", "tiny", "--seq-len", "32", "--steps", "2",
                                   "--out", str(tmp_path / name), *flags],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_tp2_pp2_trace_then_a_zero2_run_reuses_the_cached_peak(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    # 3D interleaved: 4 ranks as pp 2 x tp 2, two chunks per stage, 4 micro-batches.
    three_d = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "optimizer": _OPTIMIZER,
               "tensor_parallel": {"size": 2, "sequence_parallel": True},
               "pipeline": {"stages": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2}}
    first = _run(tmp_path, "tp2pp2", three_d, "--nproc", "4", "--pipeline-trace", cache=cache)
    trace = json.loads((tmp_path / "tp2pp2" / "pipeline_trace.json").read_text())
    assert 0.0 <= trace["bubble_fraction"] < 1.0
    labels = sorted((r["stage"], r["action"]) for r in trace["records"])
    # every stage runs each (chunk, micro-batch) forward and backward exactly once: one TP rank's records
    assert labels == sorted((s, f"{op}{m}" + (f".{c}" if c else "")) for s in (0, 1) for op in "FB"
                            for m in range(4) for c in (0, 1))
    assert all(r["start"] <= r["end"] for r in trace["records"])
    assert "(measured)" in first.stdout

    entries = json.loads((cache / "peak_flops.json").read_text())
    assert len(entries) == 1 and "|float32|threads=1|" in next(iter(entries))
    cached = next(iter(entries.values()))["flops"]
    # the run that measured divides by what it prints and caches: the 4 ranks' agreed figure, 4 times
    if not any("too low" in line for line in first.stderr.splitlines()):
        measured = json.loads((tmp_path / "tp2pp2" / "summary.json").read_text())["peak_flops"]
        assert measured == 4 * cached
        assert f"MFU divides by {format_rate(measured)} FLOP/s, the peak of the 4 rank(s)" in first.stdout

    # ZeRO-2 over 2 data-parallel ranks (its gathers went through the deprecated collective before), of an MoE
    # preset with its experts split over both (--expert-parallel 2): its figures in each row, the progress line and
    # the communication report.
    zero2 = {"train_micro_batch_size_per_gpu": 2, "optimizer": _OPTIMIZER, "zero_optimization": {"stage": 2}}
    second = _run(tmp_path, "zero2", zero2, "--nproc", "2", "--model", "gpt-moe-tiny", "--expert-parallel", "2",
                  cache=cache)
    assert "(cached)" in second.stdout
    summary = json.loads((tmp_path / "zero2" / "summary.json").read_text())
    rows = read_metrics(tmp_path / "zero2" / "metrics.jsonl")
    assert all(0 < r["mfu"] <= 1 and r["skipped"] is False for r in rows)
    layers, experts, k = 4, 4, 2          # gpt-moe-tiny; no capacity: nothing dropped
    assert all(r["moe_dropped_tokens"] == 0 and r["moe_aux_loss"] > 0 and len(r["moe_tokens_per_expert"]) == layers
               and all(len(e) == experts and sum(e) == r["tokens"] * k for e in r["moe_tokens_per_expert"])
               for r in rows)
    assert "| moe drop 0.0% load " in second.stdout
    assert any("all_to_all" in line and "ep:ep_size_2" in line for line in second.stdout.splitlines()), \
        second.stdout
    if not any("too low" in line for line in second.stderr.splitlines()):
        assert summary["peak_flops"] == 2 * cached             # both ranks read the same cached figure

    for proc in (first, second):
        noisy = [line for line in proc.stderr.splitlines() if any(n in line for n in NOISE)]
        assert not noisy, noisy


def test_a_missing_node_is_named_and_the_wait_times_out(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--rendezvous-timeout",
              "2", "--steps", "1", "--seq-len", "32", "--peak-tflops", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    host = subprocess.run(TRAIN + common + ["--node-rank", "0", "--out", str(tmp_path / "a")], env=env,
                          capture_output=True, text=True, timeout=120)
    # node 1 never came: node 0 said what it waited for, then gave up with one line
    assert host.returncode == 2, host.stderr
    assert f"node 0: waiting for 1 more node at 127.0.0.1:{port} (timeout 2 s)" in host.stdout
    assert host.stderr.strip().splitlines() == [
        f"shardwise: error: rendezvous timed out after 2 s: 1 more node of 1 did not join at 127.0.0.1:{port}; "
        f"start them with --nnodes 2 --node-rank K --master-addr 127.0.0.1 --master-port {port}, or raise "
        f"--rendezvous-timeout."]
    # node 1 alone: nobody listens at the port; one line too, no C++ stack trace from the store's retries
    joiner = subprocess.run(TRAIN + common + ["--node-rank", "1", "--out", str(tmp_path / "b")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert joiner.returncode == 2
    lines = joiner.stderr.strip().splitlines()
    assert len(lines) == 1 and "node 1 could not meet node 0" in lines[0], joiner.stderr
