"""Measure this machine as a `ClusterSpec`: CPU processes in the role of GPUs (`shardwise plan --calibrate`).

    cluster = calibrate(ranks=2)       # the probes run in a child process; this module stays torch-free
    save_cluster(cluster, "cluster.json")
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from shardwise.planner.comm import Op, ring_send_bytes
from shardwise.planner.specs import ClusterSpec, JobSpec, Optimizer, PlannerError, Precision
from shardwise.planner.time import optimizer_step_bytes

_CHUNK = 1 << 20


def _recv_exactly(sock: socket.socket, nbytes: int, buf: bytearray) -> None:
    view, left = memoryview(buf), nbytes
    while left:
        got = sock.recv_into(view[:min(left, len(buf))])
        if not got:
            raise ConnectionError("peer closed the loopback connection")
        left -= got


def _duplex(sock: socket.socket, nbytes: int) -> None:
    """Send and receive `nbytes` at once (a sender thread; this thread receives)."""
    payload, buf = bytes(_CHUNK), bytearray(_CHUNK)

    def send() -> None:
        for i in range(0, nbytes, _CHUNK):
            sock.sendall(payload[:min(_CHUNK, nbytes - i)])

    sender = threading.Thread(target=send)
    sender.start()
    _recv_exactly(sock, nbytes, buf)
    sender.join()


def _peer(port: int, nbytes: int, rounds: int, pings: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            _duplex(sock, nbytes)
        one = bytearray(1)
        for _ in range(pings):
            _recv_exactly(sock, 1, one)
            sock.sendall(b"x")


def measure_loopback(nbytes: int = 64 << 20, rounds: int = 3, pings: int = 500) -> tuple[float, float]:
    """(bytes/s per direction under full-duplex load, one-way latency in seconds) over TCP loopback: what stands
    in for the links with one rank, where there is nothing to time with gloo. Two processes connect over
    127.0.0.1 and each sends `nbytes` while receiving as many (full duplex, as in a ring step); bandwidth per
    direction = bytes / time, best of `rounds`. Latency: half the median round trip of 1-byte ping-pongs with
    TCP_NODELAY."""
    import multiprocessing as mp
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        peer = mp.get_context("fork").Process(target=_peer, args=(port, nbytes, rounds, pings), daemon=True)
        peer.start()
        conn, _ = server.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            _duplex(conn, nbytes)
            best = min(best, time.perf_counter() - t0)
        one, trips = bytearray(1), []
        for _ in range(pings):
            t0 = time.perf_counter()
            conn.sendall(b"x")
            _recv_exactly(conn, 1, one)
            trips.append(time.perf_counter() - t0)
    peer.join(timeout=10)
    trips.sort()
    return nbytes / best, trips[len(trips) // 2] / 2


def _physical_memory() -> float:
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def fit_collective(op: Op, probes: dict[str, float], ranks: int) -> tuple[float, float]:
    """(bandwidth, latency per ring step) of `op` from its small and large timings: the ring model
    t = hops * alpha + sent / B through both points (comm.py's `ring_seconds`). All-reduce's fit becomes the
    intra- and inter-node links (one host), reduce-scatter's and all-gather's their own fields."""
    name, sizes = op.value, (probes["small_bytes"], probes["large_bytes"])
    t_small, t_large = probes[f"{name}_small_s"], probes[f"{name}_large_s"]
    sent_small, sent_large = (ring_send_bytes(op, n, ranks) for n in sizes)
    hops = 2 * (ranks - 1) if op is Op.ALL_REDUCE else ranks - 1
    bw = (sent_large - sent_small) / (t_large - t_small) if t_large > t_small else sent_large / t_large
    return bw, max(0.0, t_small - sent_small / bw) / hops


def cluster_from_probes(probes: dict[str, float], *, link: tuple[float, float] | None = None) -> ClusterSpec:
    """The `ClusterSpec` of the measured figures (`probes.summarize`). `link`: (bytes/s, latency) for a
    one-rank measurement, which has no collectives to fit.

    - matmul peak (fp32; bf16 from a small bf16 linear) and gemm_operand_bw: the least-squares fit of the linear
      probes' times to FLOPs / peak + operand bytes / bandwidth (kernels.py's GEMM model), the bandwidth no lower
      than memory_bw's (below); attention: FLOPs / seconds of its probe.
    - memory_bw: the bytes time.py charges an Adam step (28 per parameter) over its measured time per parameter
      of a large tensor, so the optimizer term reproduces torch's for-loop AdamW (several passes over each state)
      on this machine; cache_bw the same for tensors that stay in the last-level cache, cache_bytes its share per
      rank.
    - comm_overlap: the share of cores left to gloo's threads, (cores - ranks * threads) / ranks, within [0, 1]:
      gloo reduces and copies on the CPU, so with every core computing nothing hides.
    - links: alpha-beta fits of each collective from its two sizes (`fit_collective`), or `link`.
    """
    ranks, threads = int(probes["ranks"]), int(probes["threads"])
    per_rank: dict[str, Any] = {}
    if ranks > 1:
        link = fit_collective(Op.ALL_REDUCE, probes, ranks)
        for op in (Op.REDUCE_SCATTER, Op.ALL_GATHER):
            bw, alpha = fit_collective(op, probes, ranks)
            per_rank.update({f"{op.value}_bw": bw, f"{op.value}_latency_s": alpha})
        # gloo reduces and copies on the CPU: with every core computing, a collective takes its time from them
        cores = os.cpu_count() or 1
        per_rank["comm_overlap"] = min(1.0, max(0.0, (cores - ranks * threads) / ranks))
    if link is None:
        raise PlannerError("cluster_from_probes: one rank measured no collectives; pass link=(bytes/s, latency)")
    adam_bytes = optimizer_step_bytes(JobSpec(global_batch=1, precision=Precision.FP32, optimizer=Optimizer.ADAM))
    optimizer_bw = adam_bytes / probes["adam_s_per_param"]
    ram, host = _physical_memory(), socket.gethostname()
    return ClusterSpec(
        name=f"calibrated:{host}", num_gpus=ranks, gpus_per_node=ranks, memory_bytes=ram / ranks,
        peak_flops_bf16=1.0 / probes["linear_bf16_s_per_flop"], peak_flops_fp32=1.0 / probes["linear_s_per_flop"],
        intra_node_bw=link[0], inter_node_bw=link[0], intra_node_latency_s=link[1], inter_node_latency_s=link[1],
        # a GEMM streams its operands at least as fast as Adam streams its states: a slower fit is load noise
        gemm_operand_bw=(max(1.0 / probes["gemm_s_per_byte"], optimizer_bw)
                         if probes.get("gemm_s_per_byte", 0.0) > 0 else 0.0),
        memory_bw=optimizer_bw, cache_bytes=probes["cache_bytes"] / ranks,     # the ranks share it
        cache_bw=adam_bytes / probes["adam_cached_s_per_param"], pcie_bw=1.0 / probes["copy_s_per_byte"],
        host_memory_bytes=ram, host_memory_bw=optimizer_bw * ranks,   # each rank steps its shard at that rate
        compute_efficiency=1.0, reserved_memory_bytes=0.0,
        attention_flops=1.0 / probes["attention_s_per_flop"], activation_s=probes["activation_s"],
        norm_s=probes["norm_s"], layer_overhead_s=probes["layer_overhead_s"],
        microbatch_overhead_s=probes["microbatch_overhead_s"], optimizer_tensor_s=probes["adam_tensor_s"],
        **per_rank,
        source=f"measured on {host}: {ranks} rank(s) at once, {threads} torch thread(s) each, torch CPU kernels "
               f"and gloo collectives (shardwise.planner.calibrate)")


def calibrate(*, ranks: int | None = None, threads: int = 1, rounds: int = 3, samples: int = 3) -> ClusterSpec:
    """Measure this machine with `ranks` processes (default: one per core / threads) playing the GPUs, each
    with `threads` threads, in a child process; `rounds` rounds of `samples` timings per probe.

    The child (`python -m shardwise.planner.probes`, torch) times, on all ranks at once, every kind of work the
    step-time model (time.py) charges: linear layers forward + backward (the matmul rate, compute_efficiency 1),
    causal attention, the GELU and LayerNorm per element, the fixed cost of a transformer block and of the rest
    of a micro-batch, torch's AdamW per parameter and per tensor, a memory copy, and gloo's all-reduce,
    reduce-scatter and all-gather at two sizes: per sample the slowest rank, then medians over samples and over
    rounds. `cluster_from_probes` turns that into figures."""
    cores = os.cpu_count() or 1
    ranks = ranks or max(1, cores // threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "shardwise.planner.probes", "--ranks", str(ranks), "--threads",
           str(threads), "--rounds", str(rounds), "--samples", str(samples)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise PlannerError(f"calibration failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}")
    probes = json.loads(proc.stdout.strip().splitlines()[-1])
    return cluster_from_probes(probes, link=measure_loopback() if ranks == 1 else None)


def save_cluster(cluster: ClusterSpec, path: str | os.PathLike) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cluster.to_dict(), f, indent=2)
            f.write("\n")
    except OSError as e:
        raise PlannerError(f"cannot write the cluster file {os.fspath(path)!r}: {e.strerror or e}") from None


def load_cluster(path: str | os.PathLike) -> ClusterSpec:
    origin = f"cluster file {os.fspath(path)!r}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise PlannerError(f"{origin}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise PlannerError(f"{origin}: not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise PlannerError(f"{origin}: must hold a JSON object")
    return ClusterSpec.from_dict(data, origin=origin)
