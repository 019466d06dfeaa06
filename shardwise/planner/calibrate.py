"""Measure this machine as a `ClusterSpec`: CPU processes in the role of GPUs (`shardwise plan --calibrate`).

Method (no torch: numpy and sockets; run in a fresh child process so the thread count is set before
numpy loads its BLAS):

- matmul FLOP/s: a float32 square matmul (numpy -> OpenBLAS/MKL sgemm) with `threads` threads, the
  thread count one rank gets. Warm-up calls, then timed calls for about `seconds`; the BEST sample
  counts, because on a shared machine noise only ever adds time. 2 n^3 FLOPs per call. numpy has no
  bf16 matmul, so the same figure stands for every precision.
- memory bandwidth: `np.copyto` of a 128 MiB buffer into another (far beyond any cache), read + write
  bytes over the best time. It bounds the optimizer step (which streams its states) and stands in for
  PCIe (host = device here).
- loopback bandwidth and latency: what gloo uses between local ranks is TCP over loopback. Two
  processes connect over 127.0.0.1 and each sends 64 MiB while receiving 64 MiB (full duplex, as in a
  ring step); bandwidth per direction = bytes / time, best of 3. Latency: half the median round trip
  of 1-byte ping-pongs with TCP_NODELAY.
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

from shardwise.planner.specs import ClusterSpec, PlannerError

_CHUNK = 1 << 20


def _best_seconds(fn: Any, seconds: float, min_samples: int = 3) -> float:
    fn()   # warm-up: thread-pool start, page faults
    best, samples, deadline = float("inf"), 0, time.perf_counter() + seconds
    while samples < min_samples or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        samples += 1
    return best


def measure_matmul_flops(size: int = 1024, seconds: float = 0.5) -> float:
    import numpy as np
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)   # [size, size]
    b = rng.standard_normal((size, size), dtype=np.float32)   # [size, size]
    out = np.empty((size, size), dtype=np.float32)
    return 2.0 * size ** 3 / _best_seconds(lambda: np.matmul(a, b, out=out), seconds)


def measure_memory_bandwidth(nbytes: int = 128 << 20, seconds: float = 0.5) -> float:
    import numpy as np
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return 2.0 * nbytes / _best_seconds(lambda: np.copyto(dst, src), seconds)


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
    """(bytes/s per direction under full-duplex load, one-way latency in seconds) over TCP loopback."""
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


def measure(threads: int = 1, seconds: float = 0.5) -> dict[str, float]:
    """Run the measurements in this process (numpy's BLAS must already be limited to `threads`)."""
    flops = measure_matmul_flops(seconds=seconds)
    mem_bw = measure_memory_bandwidth(seconds=seconds)
    link_bw, latency = measure_loopback()
    return {"matmul_flops": flops, "memory_bw": mem_bw, "loopback_bw": link_bw, "loopback_latency_s": latency,
            "threads": threads}


def calibrate(*, ranks: int | None = None, threads: int = 1, seconds: float = 0.5) -> ClusterSpec:
    """Measure in a child process with `threads` BLAS threads; `ranks` processes (default: one per
    core / threads) play the GPUs, sharing this machine's memory equally."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-m", "shardwise.planner.calibrate", str(threads), str(seconds)],
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise PlannerError(f"calibration failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}")
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    cores = os.cpu_count() or 1
    ranks = ranks or max(1, cores // threads)
    ram = _physical_memory()
    return ClusterSpec(
        name=f"calibrated:{socket.gethostname()}", num_gpus=ranks, gpus_per_node=max(ranks, cores // threads),
        memory_bytes=ram / ranks, peak_flops_bf16=m["matmul_flops"], peak_flops_fp32=m["matmul_flops"],
        intra_node_bw=m["loopback_bw"], inter_node_bw=m["loopback_bw"],
        intra_node_latency_s=m["loopback_latency_s"], inter_node_latency_s=m["loopback_latency_s"],
        memory_bw=m["memory_bw"], pcie_bw=m["memory_bw"], host_memory_bytes=ram, host_memory_bw=m["memory_bw"],
        compute_efficiency=1.0, reserved_memory_bytes=0.0,
        source=f"measured on {socket.gethostname()} with {threads} BLAS thread(s) per rank: numpy float32 "
               f"matmul, np.copyto bandwidth, TCP loopback full duplex (shardwise.planner.calibrate)")


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


if __name__ == "__main__":   # the child process of `calibrate`: argv = threads seconds
    print(json.dumps(measure(threads=int(sys.argv[1]), seconds=float(sys.argv[2]))))
