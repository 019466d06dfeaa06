"""Flat, padded buckets shared by the ZeRO-1/2 gradient reducer and the sharded optimizer.

Each bucket owns one flat parameter buffer in the model dtype; the model's parameters are rebound as views
into it, so an all-gather into the buffer updates the model in place:

    bucket.param_flat : [padded]             model dtype
    param.data        : param_flat[off : off + numel].view(shape)
    bucket.param_shard: param_flat[r * S : (r+1) * S]   this rank's part (what the optimizer updates)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardwise.comm.collectives import Comm, Handle
from shardwise.parallel.data_parallel import plan_buckets
from shardwise.parallel.zero.copies import HostGrad
from shardwise.parallel.zero.partition import FlatLayout


@dataclass
class ZeroBucket:
    index: int
    group: int                                  # optimizer param-group index
    params: list[torch.nn.Parameter]
    layout: FlatLayout
    param_flat: torch.Tensor
    rank: int
    grad_shard: torch.Tensor                    # [S] this rank's averaged gradient, model dtype
    grad_buffer: torch.Tensor | None = None     # [padded] full gradients (stage 1: kept; stage 2: transient)
    grad_views: list[torch.Tensor] = field(default_factory=list)
    ready: set[int] = field(default_factory=set)
    handle: Handle | None = None                # the reduce-scatter in flight
    received: torch.Tensor | None = None        # stage 2: [S] reduce-scatter output of one micro-batch
    # ZeRO-Offload (set by the updater): the boundary's final grad_shard goes to its pinned host copy [S] (model
    # dtype) on a side stream as soon as the bucket is reduced.
    host: HostGrad | None = None
    # The parameters' own replica group (experts' expert-dp group: `parallel/replicas.py`), over which this bucket
    # is sharded, reduce-scattered and gathered; None: the dp group. Gradients still divide by the dp size.
    comm: Comm | None = None

    @property
    def shard(self) -> slice:
        r = self.layout.shard(self.rank)
        return slice(r.start, r.stop)

    @property
    def shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.params]

    @property
    def param_shard(self) -> torch.Tensor:
        return self.param_flat[self.shard]

    def flat_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + n].view(p.shape) for p, o, n in zip(self.params, self.layout.offsets, self.layout.sizes)]


def _plan(params: list[torch.nn.Parameter], bucket_numel: int, alone: set[int]) -> list[list[int]]:
    """`plan_buckets` between the parameters in `alone`, each of which gets a bucket of its own."""
    out: list[list[int]] = []
    start = 0
    for i, p in enumerate([*params, None]):
        if p is None or id(p) in alone:
            out += [[start + j for j in b] for b in plan_buckets([q.numel() for q in params[start:i]], bucket_numel)]
            if p is not None:
                out.append([i])
            start = i + 1
    return out


@torch.no_grad()
def build_zero_buckets(groups: list[list[torch.nn.Parameter]], *, dp_size: int, dp_rank: int,
                       bucket_numel: int, alone: set[int] | None = None, comm: Comm | None = None,
                       first_index: int = 0) -> list[ZeroBucket]:
    """Buckets over every param group (last group first, parameters in reverse order: roughly the order
    backward produces their gradients), each padded to a multiple of dp_size; parameters are rebound as
    views of their bucket's flat buffer. A parameter whose id is in `alone` gets a bucket of its own."""
    buckets: list[ZeroBucket] = []
    for g in reversed(range(len(groups))):
        order = [p for p in reversed(groups[g]) if p.requires_grad]
        for dtype in dict.fromkeys(p.dtype for p in order):
            same = [p for p in order if p.dtype == dtype]
            for idx in _plan(same, bucket_numel, alone or set()):
                params = [same[i] for i in idx]
                layout = FlatLayout(tuple(p.numel() for p in params), dp_size)
                flat = torch.zeros(layout.padded_numel, dtype=dtype, device=params[0].device)
                bucket = ZeroBucket(first_index + len(buckets), g, params, layout, flat, dp_rank,
                                    grad_shard=torch.zeros(layout.shard_numel, dtype=dtype, device=flat.device),
                                    comm=comm)
                for p, view in zip(params, bucket.flat_views(flat)):
                    view.copy_(p.detach())
                    p.data = view
                buckets.append(bucket)
    return buckets
