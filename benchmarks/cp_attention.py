"""The attentions `shardwise bench cp` compares ours with, put in place of a built engine's context-parallel attention
(benchmark only, not library modes):

- `AllGatherAttention`: every cp rank all-gathers the keys and values of the whole sequence and attends its own
  queries to them (Megatron-Core's "all_gather" context-parallel mode). What ring attention must beat in memory:
  it stores the whole sequence's keys and values, repeated to the query heads, on every rank.
- `DeepSpeedUlysses`: DeepSpeed's `deepspeed.sequence.layer.DistributedAttention` (Ulysses) around causal SDPA.

torch's own `context_parallel` (torch.distributed.tensor.experimental) is not among them: on the CPU it cannot run
(see `TORCH_CONTEXT_PARALLEL_ON_CPU`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TORCH_CONTEXT_PARALLEL_ON_CPU = (
    "torch's context_parallel does not run on the CPU: its ring attention replaces only the CUDA SDPA kernels "
    "(aten._scaled_dot_product_flash_attention / _efficient_attention / _cudnn_attention), while SDPA on the CPU "
    "calls aten._scaled_dot_product_flash_attention_for_cpu, which has no sharding strategy (NotImplementedError); "
    "forcing the math backend fails on a plain-tensor causal mask mixed with DTensors, and the efficient backend "
    "has no CPU kernel. Compared instead with all-gathering every key and value (Megatron's all_gather mode).")


class _GatherKV(torch.autograd.Function):
    """[2, B, Hkv, s, D] on each of C ranks -> [C, 2, B, Hkv, s, D] on every rank; backward: each rank gets the sum
    over ranks of the gradient at its own block (a reduce-scatter, as Megatron's all_gather mode runs)."""

    @staticmethod
    def forward(ctx: Any, kv: Tensor, comm: Any) -> Tensor:
        ctx.comm = comm
        out = torch.empty((comm.size, *kv.shape), dtype=kv.dtype, device=kv.device)
        comm.all_gather_into_tensor(out.view(-1), kv.contiguous().view(-1)).wait()
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        comm = ctx.comm
        mine = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        comm.reduce_scatter_sum(mine.view(-1), grad.contiguous().view(-1), tag=GATHER_TAG).wait()
        return mine, None


GATHER_TAG = 7001
"""Tag of the key/value gradients' reduce-scatter (one in flight at a time on the cp group)."""


class AllGatherAttention:
    """Causal attention of this rank's queries q [B, H, s, D] over the whole sequence, whose keys and values
    k, v [B, Hkv, s, D] every rank all-gathers first: [2, B, Hkv, s, D] from each of the C ranks, reassembled in
    sequence order to [B, Hkv, S, D] and repeated to the query heads for SDPA with this rank's causal mask."""

    def __init__(self, comm: Any, layout: Any):
        self.comm, self.layout = comm, layout

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor:
        from shardwise.parallel.context import SequenceLayout
        s, size = q.shape[-2], self.layout.size
        parts = _GatherKV.apply(torch.stack([k, v]), self.comm)            # [C, 2, B, Hkv, s, D]
        pieces: dict[int, Tensor] = {}
        for rank in range(size):                                             # each rank's spans, in its order
            offset = 0
            for start, stop in SequenceLayout(size, rank, self.layout.balanced).spans(s * size):
                pieces[start] = parts[rank, ..., offset:offset + stop - start, :]
                offset += stop - start
        kv = torch.cat([pieces[start] for start in sorted(pieces)], dim=-2)  # [2, B, Hkv, S, D]
        groups = q.shape[1] // k.shape[1]
        full_k, full_v = (x.repeat_interleave(groups, dim=1) if groups > 1 else x for x in (kv[0], kv[1]))
        mask = None
        if causal:
            queries = self.layout.positions(s, q.device)                     # [s] positions in the sequence
            keys = torch.arange(s * size, device=q.device)
            mask = keys.unsqueeze(0) <= queries.unsqueeze(1)                 # [s, S]: True where q may see k
        return F.scaled_dot_product_attention(q, full_k, full_v, attn_mask=mask)


class _LocalCausalSDPA(nn.Module):
    """DeepSpeed's local attention in its batch-first layout: [B, S, h, D] in and out (kv heads repeated)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        from shardwise.parallel.context import grouped_sdpa
        out = grouped_sdpa(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
        return out.transpose(1, 2)


class DeepSpeedUlysses:
    """DeepSpeed's DistributedAttention (all-to-all on the head dimension 2 of [B, s, H, D], gather on the
    sequence dimension 1) in place of ours; key/value heads fewer than the ranks are repeated first, as ours
    does (DeepSpeed scatters whole heads)."""

    def __init__(self, comm: Any, layout: Any):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.sequence.layer import DistributedAttention
        self.size = comm.size
        self.inner = DistributedAttention(_LocalCausalSDPA(), comm.group, scatter_idx=2, gather_idx=1)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor:
        from shardwise.parallel.context.ulysses import kv_for_ranks
        assert causal
        k, v = kv_for_ranks(k, self.size), kv_for_ranks(v, self.size)
        out: Tensor = self.inner(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)
        return out.transpose(1, 2)


def init_deepspeed_comm() -> None:
    """DeepSpeed's comm layer over the running gloo group (its CPU shared-memory kernel off: it would be compiled
    on the spot)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.comm
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def replace_cp_attention(model: nn.Module, make: Any) -> int:
    """Put `make(comm, layout)` (the cp group's Comm and this rank's layout) in place of every context-parallel
    attention core's attention; returns how many."""
    from shardwise.parallel.context import ContextParallelCore
    cores = [m for m in model.modules() if isinstance(m, ContextParallelCore)]
    for core in cores:
        current = core.attention
        core.attention = make(current.comm, current.layout)
    return len(cores)
