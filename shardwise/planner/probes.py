"""The micro-benchmarks behind `shardwise plan --calibrate`: what one rank of this machine sustains on each kind
of work the planner's step-time model charges (shardwise/planner/time.py), timed with torch as the engine runs.

    python -m shardwise.planner.probes --ranks 2 --rounds 3    # prints the figures as JSON

Every rank of a `ranks`-process gloo world runs the same probes at the same time (a barrier before each sample),
so each figure is what a rank gets while all of them work: with more ranks than idle cores, less. The one module
of the planner that imports torch: calibrate.py runs it in a child process and nothing that
`import shardwise.planner` loads imports it, so the planner and `shardwise plan` stay torch-free.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

SMALL_BYTES, LARGE_BYTES = 4 << 10, 8 << 20
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
_LINEAR_SHAPES = ((1024, 256, 1024), (1024, 1024, 256), (2048, 64, 2048))   # (tokens M, in K, out N)
# the third is thin (64 FLOPs per element it streams against ~180): it separates operand traffic from FLOPs
_LINEAR_BF16_SHAPE = (256, 256, 256)                          # bf16 runs far below fp32 without AMX/AVX-512
_ATTENTION_SHAPES = ((2, 4, 256, 64), (4, 6, 128, 32))       # (batch, heads, seq, head dim)
_NUMEL = 1 << 20
_CACHED, _TINY = (8, 1 << 18), (64, 1 << 10)                 # (tensors, elements each) of the Adam fit
_GELU, _NORM, _TINY_SEQ = (1024, 1024), (2048, 384), 4

Samples = dict[str, list[float]]


def _ranks() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _times(fn: Callable[[], object], samples: int) -> list[float]:
    """Seconds of `samples` calls of `fn`, each started together on every rank (after one warm-up call:
    allocations, lazy kernel selection)."""
    out = []
    for i in range(samples + 1):
        if _ranks() > 1:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        if i:
            out.append(time.perf_counter() - t0)
    return out


def _linear(shape: tuple[int, int, int], dtype: torch.dtype, samples: int) -> list[float]:
    m, k, n = shape
    x = torch.randn(m, k, dtype=dtype, requires_grad=True)        # [M, K]
    w = torch.randn(n, k, dtype=dtype, requires_grad=True)        # [N, K], as nn.Linear stores it
    bias = torch.zeros(n, dtype=dtype, requires_grad=True)
    grad = torch.randn(m, n, dtype=dtype)                         # [M, N]
    return _times(lambda: F.linear(x, w, bias).backward(grad), samples)


def _attention(shape: tuple[int, int, int, int], samples: int) -> list[float]:
    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))     # [b, h, s, d_head]
    grad = torch.randn(*shape)
    return _times(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad), samples)


def _pointwise(fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, int], samples: int) -> list[float]:
    x = torch.randn(*shape, requires_grad=True)
    grad = torch.randn(*shape)
    return _times(lambda: fn(x).backward(grad), samples)


def _tiny_gpt(n_layer: int, samples: int) -> list[float]:
    """Our GPT forward + backward at a size with next to no arithmetic: what its operators cost to run."""
    from shardwise.models import GPT, gpt_config
    cfg = gpt_config("tiny", n_layer=n_layer, d_model=8, n_head=2, seq_len=_TINY_SEQ, vocab_size=8)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, _TINY_SEQ))                   # [1, s]
    return _times(lambda: model(ids, ids).backward(), samples)


def _adam(tensors: int, numel: int, samples: int) -> list[float]:
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)     # the engine's optimizer, as configured
    return _times(opt.step, samples)


def _collective(op: str, nbytes: int, samples: int) -> list[float]:
    """One collective through `shardwise.comm.Comm`, as the engine calls it: ZeRO's gradient reduce-scatter is
    `reduce_scatter_sum` where the library has it (on gloo a pairwise exchange: gloo's own reduce-scatter is a
    whole all-reduce)."""
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    comm = Comm(None, CommLedger(), name="probe")
    p = comm.size
    n = nbytes // 4                                                # fp32 elements, a multiple of p
    full, shard = torch.randn(n), torch.randn(n // p)
    gathered, reduced = torch.empty(n), torch.empty(n // p)
    scatter = getattr(comm, "reduce_scatter_sum", None)
    call = {"all_reduce": lambda: comm.all_reduce(full),
            "reduce_scatter": (lambda: scatter(reduced, full, tag=0)) if scatter else
                              (lambda: comm.reduce_scatter_tensor(reduced, full)),
            "all_gather": lambda: comm.all_gather_into_tensor(gathered, shard)}[op]

    def timed() -> None:
        comm.ledger.begin_step(0)          # keep the ledger from growing
        call()
    return _times(timed, samples)


def _copy(samples: int) -> list[float]:
    src, dst = torch.randn(_NUMEL), torch.empty(_NUMEL)
    return _times(lambda: dst.copy_(src), samples)


Probe = tuple[str, Callable[[], list[float]]]


def probes(samples: int) -> list[Probe]:
    """Every probe as (name, a call that returns the seconds of its `samples` timings), to run in any order
    (a benchmark may interleave them with its own work) on all ranks of the current world together."""
    plan: list[Probe] = [(f"linear{i}", functools.partial(_linear, shape, torch.float32, samples))
                         for i, shape in enumerate(_LINEAR_SHAPES)]
    plan.append(("linear_bf16", functools.partial(_linear, _LINEAR_BF16_SHAPE, torch.bfloat16, 1)))
    plan += [(f"attention{i}", functools.partial(_attention, shape, samples))
             for i, shape in enumerate(_ATTENTION_SHAPES)]
    plan += [("gelu", functools.partial(_pointwise, functools.partial(F.gelu, approximate="tanh"), _GELU, samples)),
             ("norm", functools.partial(_pointwise, lambda x: F.layer_norm(x, x.shape[-1:]), _NORM, samples)),
             ("gpt_1_layer", functools.partial(_tiny_gpt, 1, samples)),
             ("gpt_4_layers", functools.partial(_tiny_gpt, 4, samples)),
             ("adam", functools.partial(_adam, 1, 4 * _NUMEL, samples)),
             ("adam_cached", functools.partial(_adam, *_CACHED, samples)),
             ("adam_tiny", functools.partial(_adam, *_TINY, samples)),
             ("copy", functools.partial(_copy, samples))]
    if _ranks() > 1:
        plan += [(f"{op}_{tag}", functools.partial(_collective, op, nbytes, samples)) for op in COLLECTIVES
                 for nbytes, tag in ((SMALL_BYTES, "small"), (LARGE_BYTES, "large"))]
    return plan


def measure_round(samples: int = 3) -> Samples:
    """Seconds of each probe's `samples` calls on this rank, all ranks of the current world (or this process
    alone) together."""
    return {name: call() for name, call in probes(samples)}


def _cache_bytes() -> int:
    """The last-level (level 3) cache the OS reports, in bytes; 0 when it does not say."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size", encoding="ascii") as f:
            text = f.read().strip().upper()
    except OSError:
        return 0
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("KM") or 0) * scale


def fit_gemm(seconds: list[float]) -> tuple[float, float]:
    """(seconds per FLOP, seconds per operand byte) of the linear probes, t = 6 M K N a + 12 (M K + K N + M N) c
    (fp32, three GEMMs a call) by least squares over the shapes; (time / FLOPs of the first two, 0) when the
    fit gives no positive traffic term (noise, or a machine whose GEMMs are compute-bound at these shapes)."""
    flops = [6.0 * m * k * n for m, k, n in _LINEAR_SHAPES]
    nbytes = [12.0 * (m * k + k * n + m * n) for m, k, n in _LINEAR_SHAPES]
    ff = sum(f * f for f in flops)
    bb = sum(b * b for b in nbytes)
    fb = sum(f * b for f, b in zip(flops, nbytes))
    ft = sum(f * x for f, x in zip(flops, seconds))
    bt = sum(b * x for b, x in zip(nbytes, seconds))
    det = ff * bb - fb * fb
    if det > 0:
        a, c = (ft * bb - bt * fb) / det, (bt * ff - ft * fb) / det
        if a > 0 and c > 0:
            return a, c
    return sum(seconds[:2]) / sum(flops[:2]), 0.0


def summarize(per_rank: list[list[Samples]], threads: int | None = None) -> dict[str, float]:
    """`per_rank[r]`: rank r's rounds (`measure_round`). Per sample the slowest rank (a synchronous step waits
    for it), then the median over samples, then over rounds; then these figures:

    linear_s_per_flop         F.linear forward + backward at two transformer shapes and a thin one, 6 M K N
    gemm_s_per_byte           FLOPs a call, 3 x 4 (M K + K N + M N) bytes streamed: t = FLOPs a + bytes c fitted
                              by least squares (c = 0 and a = time / FLOPs of the two square-ish shapes when the
                              fit finds no traffic term)
    linear_bf16_s_per_flop    the same in bf16 at a small shape
    attention_s_per_flop      causal scaled_dot_product_attention forward + backward at head dims 64 and 32,
                              counted as 12 b h s^2 d_head (flops.py's 4 b s^2 h forward, the mask ignored,
                              times 3)
    activation_s, norm_s      tanh-GELU / LayerNorm forward + backward, per element
    layer_overhead_s          one block of our GPT forward + backward at d_model 8, 4 tokens: the fixed cost of
                              its operators (dispatch, autograd, launch); microbatch_overhead_s the rest of
                              the model's (embedding, head, loss), from 1 and 4 blocks
    adam_s_per_param          torch's AdamW (the engine's) on one flat tensor of 4 Mi elements, per element:
                              its parameter, gradient and states (64 MiB) stream from memory
    adam_cached_s_per_param   the same while they stay in the last-level cache (cache_bytes, as the OS
                              reports it), and adam_tensor_s the fixed cost of each tensor: from 8 tensors
                              of 256 Ki elements (4 MiB each) and 64 of 1 Ki
    copy_s_per_byte           a 4 MiB tensor copy
    <op>_small_s, <op>_large_s   all_reduce / reduce_scatter / all_gather of 4 KiB and 8 MiB through the
                              library's Comm, as the engine runs them (ranks > 1)
    """
    ranks, rounds = len(per_rank), len(per_rank[0])
    t = {name: statistics.median(
            statistics.median(max(s) for s in zip(*(per_rank[r][i][name] for r in range(ranks))))
            for i in range(rounds))
         for name in per_rank[0][0]}
    def rate(prefix: str, flops: list[float]) -> float:     # seconds per FLOP over the probe's shapes
        return sum(t[f"{prefix}{i}"] for i in range(len(flops))) / sum(flops)
    (cached_k, cached_n), (tiny_k, tiny_n) = _CACHED, _TINY
    per_cached = max(1e-12, (t["adam_cached"] / cached_k - t["adam_tiny"] / tiny_k) / (cached_n - tiny_n))
    per_flop, per_byte = fit_gemm([t[f"linear{i}"] for i in range(len(_LINEAR_SHAPES))])
    out = {
        "linear_s_per_flop": per_flop, "gemm_s_per_byte": per_byte,
        "linear_bf16_s_per_flop": t["linear_bf16"] / (6.0 * _LINEAR_BF16_SHAPE[0] ** 3),
        "attention_s_per_flop": rate("attention", [12.0 * b * h * q * q * d for b, h, q, d in _ATTENTION_SHAPES]),
        "activation_s": t["gelu"] / (_GELU[0] * _GELU[1]), "norm_s": t["norm"] / (_NORM[0] * _NORM[1]),
        "layer_overhead_s": max(0.0, (t["gpt_4_layers"] - t["gpt_1_layer"]) / 3),     # noise can invert them
        "microbatch_overhead_s": max(0.0, (4 * t["gpt_1_layer"] - t["gpt_4_layers"]) / 3),
        "adam_s_per_param": t["adam"] / (4 * _NUMEL), "adam_cached_s_per_param": per_cached,
        "adam_tensor_s": max(0.0, t["adam_tiny"] / tiny_k - tiny_n * per_cached),
        "cache_bytes": float(_cache_bytes()), "copy_s_per_byte": t["copy"] / (4 * _NUMEL),
        "ranks": float(ranks), "threads": float(threads or torch.get_num_threads()),
        "small_bytes": float(SMALL_BYTES), "large_bytes": float(LARGE_BYTES),
    }
    if ranks > 1:
        out.update({f"{op}_{tag}_s": t[f"{op}_{tag}"] for op in COLLECTIVES for tag in ("small", "large")})
    return out


def _rank_rounds(rounds: int, samples: int) -> list[Samples]:
    return [measure_round(samples) for _ in range(rounds)]


def main(argv: list[str] | None = None) -> None:
    from shardwise.testing import run_distributed
    p = argparse.ArgumentParser(description="time this machine's primitives for `shardwise plan --calibrate`")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=3)
    args = p.parse_args(argv)
    per_rank = run_distributed(_rank_rounds, args.ranks, args=(args.rounds, args.samples), timeout=600,
                               threads_per_rank=args.threads)
    print(json.dumps(summarize(per_rank, args.threads)))


if __name__ == "__main__":
    main()
