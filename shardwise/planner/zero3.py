"""ZeRO-3: what is gathered at once (a transformer block per all-gather in our engine, `Zero3Gather.BLOCK`; each
module from its hooks in DeepSpeed, `Zero3Gather.MODULE`, several smaller collectives per block), how far ahead,
how much of it hides, and the buffers it takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.models.presets import GPTConfig
from shardwise.planner.flops import (
    layer_params, moe_blocks_per_stage, moe_params, norm_params, params_per_rank, stage_layers,
)
from shardwise.planner.specs import JobSpec, Plan, Zero3Gather


def module_elements(model: GPTConfig, tp: int) -> list[int]:
    """Elements of each module of one block on one TP rank, as DeepSpeed gathers them: QKV (fused), output,
    MLP input (gate and up for SwiGLU), MLP output, two norms. Biases go with their module; the row-parallel
    ones (output, MLP output) are whole on every rank."""
    d, kv, f, b = model.d_model, model.kv_dim, model.d_ff, int(model.bias)
    assert f is not None
    mlp_in = [f] * (2 if model.mlp == "swiglu" else 1)
    split = [(d + 2 * kv) * (d + b)] + [n * (d + b) for n in mlp_in]      # column-parallel: weight + bias rows
    return ([-(-n // tp) for n in split] + [-(-d * d // tp) + b * d, -(-f * d // tp) + b * d]
            + [norm_params(model)] * 2)


def unit_elements(model: GPTConfig, job: JobSpec, tp: int, ep: int = 1) -> int:
    """The largest unit gathered at once on one TP rank: a block (an MoE block with its E / ep experts)."""
    if job.zero3_gather is Zero3Gather.MODULE:
        return max(module_elements(model, tp))
    moe = moe_params(model)
    return layer_params(model).per_tp_rank(tp) + (moe.non_expert_delta(tp) + moe.expert_params(tp, ep)
                                                  if moe.layers else 0)


def units_per_block(model: GPTConfig, job: JobSpec) -> int:
    return len(module_elements(model, 1)) if job.zero3_gather is Zero3Gather.MODULE else 1


def prefetch_depth(model: GPTConfig, job: JobSpec, tp: int, ep: int = 1) -> int:
    """Units gathered ahead of the compute, from the prefetch bucket (the config's stage3_prefetch_bucket_size).
    Our engine launches a unit only if it fits in the bucket: bucket // unit. DeepSpeed always launches the next
    one while the bucket is not full: max(1, bucket // unit) for any bucket > 0. Depth 0: every gather waits."""
    bucket, unit = job.zero3_prefetch_elements, unit_elements(model, job, tp, ep)
    if job.zero3_gather is Zero3Gather.MODULE:
        return max(1, bucket // unit) if bucket > 0 else 0
    return bucket // unit


def buffer_elements(model: GPTConfig, job: JobSpec, plan: Plan) -> int:
    """Gathered parameters held at once (memory.py): our engine holds two gathered blocks, the one computing and
    the one prefetched (what the engine measures); DeepSpeed the module computing plus the prefetched modules:
    its largest module plus the larger of that module and the bucket."""
    unit = unit_elements(model, job, plan.tp, plan.ep)
    if job.zero3_gather is Zero3Gather.MODULE:
        bucket = job.zero3_prefetch_elements
        return unit + (max(unit, bucket) if bucket > 0 else 0)
    return 2 * unit


@dataclass(frozen=True)
class Zero3Shape:
    """What the overlap of one rank's ZeRO-3 traffic depends on besides time."""

    layers: int          # blocks on this rank's pipeline stage
    block_share: float   # the blocks' part of the rank's parameters
    depth: int           # units gathered ahead (`prefetch_depth`)


def shape_of(model: GPTConfig, job: JobSpec, plan: Plan) -> Zero3Shape:
    layers = stage_layers(model.n_layer, plan.pp)[0]
    moe = moe_params(model)
    blocks = (layers * layer_params(model).per_tp_rank(plan.tp) + moe_blocks_per_stage(model, plan.pp)[0]
              * (moe.non_expert_delta(plan.tp) + moe.expert_params(plan.tp, plan.ep)))
    return Zero3Shape(layers, min(1.0, blocks / params_per_rank(model, tp=plan.tp, pp=plan.pp, ep=plan.ep)),
                      prefetch_depth(model, job, plan.tp, plan.ep))


def exposed_seconds(*, gather_s: float, reduce_s: float, block_share: float, layers: int, forward_s: float,
                    backward_s: float, depth: int, overlap_reduce: bool, share: float) -> float:
    """Exposed seconds of one micro-batch's ZeRO-3 traffic. `gather_s` / `reduce_s`: one all-gather /
    reduce-scatter of all the rank's parameters (at the cluster's gather_efficiency share of the link, comm.py);
    `block_share`: the blocks' part of them; `forward_s` / `backward_s`: one block's compute in each pass
    (recomputation in backward).

    A unit's gather can run only while an earlier unit computes, and the link carries one gather at a time, so
    with depth >= 1 a pass over L blocks of compute c and gather g per block leaves exposed

        g (the first block) + (L - 1) max(0, g - c)

    and the parameters outside the blocks (embeddings, head, final norm) are gathered before anything computes:
    exposed whole. In backward the link also carries each block's gradient reduce-scatter r when the job overlaps
    gradient reduction (g + r in place of g, and the last r exposed); otherwise every reduce-scatter waits. With
    depth 0 everything is exposed. Of what could hide, `share` (the cluster's comm_overlap) does."""
    total = 2 * gather_s + reduce_s
    if depth == 0 or layers == 0:
        return total
    g, r = gather_s * block_share / layers, reduce_s * block_share / layers
    g_rest, r_rest = gather_s * (1 - block_share), reduce_s * (1 - block_share)
    forward = g_rest + g + (layers - 1) * max(0.0, g - forward_s)
    if overlap_reduce:
        backward = g_rest + r_rest + g + (layers - 1) * max(0.0, g + r - backward_s) + r
    else:
        backward = g_rest + g + (layers - 1) * max(0.0, g - backward_s) + reduce_s
    ideal = forward + backward
    return total - share * (total - ideal)
