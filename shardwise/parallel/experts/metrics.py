"""What the MoE layers did in one optimizer step, over every data-parallel rank: the telemetry of a step.

Each `MoELayer` sums, over its training forwards of the step, the choices each expert kept, the choices dropped
over capacity, and its two auxiliary losses (`MoELayer.take_step_stats`). `moe_step_metrics` sums those over the
data-parallel ranks with one all-reduce (all layers at once) and reads them on the host once:

    moe_tokens_per_expert   [[int] * E] per MoE layer: (token, choice) pairs each expert ran, all ranks' tokens
    moe_dropped_tokens      (token, choice) pairs dropped over capacity, all layers and ranks (0 without dropping)
    moe_aux_loss            the load-balancing loss without its coefficient, mean over layers, forwards and ranks
    moe_z_loss              the router z-loss likewise
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.comm.collectives import Comm
from shardwise.parallel.experts.layer import moe_layers

MOE_METRIC_KEYS = ("moe_tokens_per_expert", "moe_dropped_tokens", "moe_aux_loss", "moe_z_loss")


def moe_step_metrics(model: nn.Module, comm: Comm) -> dict[str, Any]:
    """The step's MoE figures of `model` summed over `comm` (the data-parallel group); {} for a model without MoE
    layers, with no collective (every rank holds the same kind of layers, so every rank agrees)."""
    layers = list(moe_layers(model))
    if not layers:
        return {}
    taken = [layer.take_step_stats() for layer in layers]
    stats = torch.cat([s.to(taken[0][0].device) for s, _ in taken]
                      + [torch.tensor([float(n) for _, n in taken], dtype=torch.float64, device=taken[0][0].device)])
    comm.all_reduce(stats)
    host = stats.tolist()
    per_layer, at = [], 0
    for layer in layers:
        e = layer.cfg.num_experts
        per_layer.append(host[at:at + e + 3])
        at += e + 3
    forwards = host[at:]
    runs = sum(forwards)
    return {
        "moe_tokens_per_expert": [[int(round(v)) for v in row[:-3]] for row in per_layer],
        "moe_dropped_tokens": int(round(sum(row[-3] for row in per_layer))),
        "moe_aux_loss": sum(row[-2] for row in per_layer) / runs if runs else None,
        "moe_z_loss": sum(row[-1] for row in per_layer) / runs if runs else None,
    }
