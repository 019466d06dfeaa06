"""Which contiguous layers each pipeline stage (and each of its model chunks) holds. Pure arithmetic.

The model is a sequence of L layers cut into P * V contiguous model chunks, in model order; model
chunk k goes to stage k % P as its local chunk k // P (see `schedules`). With V = 1 that is simply
one slice per stage.
"""

from __future__ import annotations

import bisect
import difflib
import math
from typing import Sequence

from shardwise.config import PipelinePartition
from shardwise.parallel.pipeline.schedules import PipelineError


def parse_partition_method(name: str | PipelinePartition) -> PipelinePartition:
    """The partition enum for ``name``; an unknown name is an error suggesting the closest valid one."""
    if isinstance(name, PipelinePartition):
        return name
    try:
        return PipelinePartition(name.strip().lower())
    except ValueError:
        valid = [k.value for k in PipelinePartition]
        close = difflib.get_close_matches(name.strip().lower(), valid, n=1, cutoff=0.4)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PipelineError(f"pipeline partition = {name!r} is unknown; valid: {', '.join(valid)}{hint}") from None


def partition_layers(costs: Sequence[float], num_stages: int, method: str | PipelinePartition = "uniform", *,
                     virtual_stages: int = 1) -> list[range]:
    """Cut ``len(costs)`` layers into ``num_stages * virtual_stages`` contiguous model chunks.

    Returns the layer ranges in model order (model chunk k = element k). ``costs`` are per-layer
    parameter counts or FLOPs; "uniform" uses only their number.

    - "uniform": equal layer counts; when L is not a multiple of the number of chunks, the first
      L % (P*V) chunks get one layer more (DeepSpeed's ``partition_uniform``). With V > 1 every chunk
      must have the same count (Megatron's rule), so L must be a multiple of P * V.
    - "parameters" / "flops": contiguous chunks that minimise the largest chunk load (`_balanced`).
      All-zero costs fall back to "uniform".
    """
    kind = parse_partition_method(method)
    num_layers = len(costs)
    if num_stages < 1:
        raise PipelineError(f"pipeline stages = {num_stages}: needs at least 1 stage")
    if virtual_stages < 1:
        raise PipelineError(f"virtual_stages = {virtual_stages}: needs at least 1 model chunk per stage")
    parts = num_stages * virtual_stages
    if num_stages > num_layers:
        raise PipelineError(f"pipeline stages = {num_stages} is more than the model's {num_layers} layer(s): "
                            f"every stage needs at least one layer; use at most {num_layers} stage(s)")
    if parts > num_layers:
        raise PipelineError(f"{num_stages} stages x {virtual_stages} virtual stages = {parts} model chunks, but the "
                            f"model has {num_layers} layer(s): every chunk needs a layer; lower virtual_stages to "
                            f"at most {num_layers // num_stages}")
    for i, c in enumerate(costs):
        if not (isinstance(c, (int, float)) and math.isfinite(c) and c >= 0):
            raise PipelineError(f"layer {i} cost = {c!r}: costs must be finite numbers >= 0")
    if kind is PipelinePartition.UNIFORM or sum(costs) == 0:
        if virtual_stages > 1 and num_layers % parts:
            raise PipelineError(f"virtual_stages = {virtual_stages} does not divide the layers: {num_layers} layer(s) "
                                f"over {num_stages} stages x {virtual_stages} chunks; with virtual stages every "
                                f"chunk gets the same number of layers, so the layer count must be a multiple "
                                f"of {parts} (or use partition 'parameters' / 'flops')")
        return _uniform(num_layers, parts)
    return _balanced(list(costs), parts)


def stage_layers(chunks: Sequence[range], *, stage: int, num_stages: int) -> list[range]:
    """The layer ranges of ``stage``'s local chunks 0..V-1, from `partition_layers`' model-order list."""
    return list(chunks[stage::num_stages])


def _uniform(num_layers: int, parts: int) -> list[range]:
    base, extra = divmod(num_layers, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _balanced(costs: list[float], parts: int) -> list[range]:
    """The contiguous chunks that minimise the largest chunk load. The optimum is exact (binary search over the
    candidate loads, which are sums of contiguous runs, with a greedy feasibility test). Among the optimal cuts,
    the one with the most even loads (least sum of squares) wins."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    n = len(costs)

    def load(i: int, j: int) -> float:  # layers i..j-1; always computed the same way, so ties compare exactly
        return prefix[j] - prefix[i]

    # The optimal max load is the load of some contiguous run: search the sorted candidates.
    candidates = sorted({load(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    lo = bisect.bisect_left(candidates, max(costs))
    hi = len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(n, parts, candidates[mid], load):
            hi = mid
        else:
            lo = mid + 1
    return _cut(n, parts, candidates[lo], load)


def _fits(n: int, parts: int, limit: float, load) -> bool:
    """Can n layers go in <= parts contiguous chunks with no chunk over ``limit``? (greedy is optimal)"""
    used, start = 1, 0
    for j in range(1, n + 1):
        if load(start, j) > limit:
            used, start = used + 1, j - 1
            if used > parts:
                return False
    return True


def _cut(n: int, parts: int, limit: float, load) -> list[range]:
    """Among the cuts with no chunk over ``limit``, the one with the least sum of squared loads (the most
    even spread below the bottleneck): exact dynamic programme over (chunks used, layers placed)."""
    inf = float("inf")
    # best[k][j]: least sum of squares putting layers 0..j-1 into k chunks; cut[k][j]: where chunk k starts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(j - 1, k - 2, -1):
                size = load(i, j)
                if size > limit:
                    break  # loads only grow as the chunk extends to the left (costs >= 0)
                value = best[k - 1][i] + size * size
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
