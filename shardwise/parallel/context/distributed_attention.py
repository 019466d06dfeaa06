"""DeepSpeed's Ulysses module, `DistributedAttention(local_attention, sequence_process_group, scatter_idx=2,
gather_idx=0)`, over our all-to-alls (`ulysses.py`), for scripts written against DeepSpeed.

DeepSpeed's tensor conventions: q, k, v come as this rank's part of the sequence with the heads at dim 2, either
sequence-first [s/P, b, H, d] (`batch_dim_idx` = 1, Megatron's layout) or batch-first [b, s/P, H, d]
(`batch_dim_idx` = 0). `local_attention` is called with whole sequences of H/P heads in the same layout
([S, b, H/P, d] or [b, S, H/P, d]) and must return its output in that layout; the result is this rank's part of
the sequence again, all heads. `rotary_pos_emb`, a (cos, sin) pair shaped [b or 1, S, 1, rot_dim], is applied to
q and k after the exchange, to the first rot_dim features (half-split pairs), as DeepSpeed does.

Differences, refused in one line: key/value heads not divisible by P (DeepSpeed splits them unevenly), other
scatter / gather indices. `sp_stream` is accepted and unused (the exchanges run on the current stream).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.errors import UserError
from shardwise.parallel.context.ulysses import HeadsToSeq, SeqToHeads


def _to_bhsd(x: Tensor, batch_dim_idx: int) -> Tensor:
    """[b, s, h, d] (batch_dim_idx 0) or [s, b, h, d] (1) -> [b, h, s, d]."""
    return x.transpose(1, 2) if batch_dim_idx == 0 else x.permute(1, 2, 0, 3)


def _from_bhsd(x: Tensor, batch_dim_idx: int) -> Tensor:
    """The inverse of `_to_bhsd`."""
    return x.transpose(1, 2) if batch_dim_idx == 0 else x.permute(2, 0, 1, 3)


def _rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary positions on the first cos.shape[-1] features of t (pairs i, i + rot/2); the rest pass through."""
    rot = cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    first, second = head.chunk(2, dim=-1)
    rotated = head * cos + torch.cat([-second, first], dim=-1) * sin
    return rotated if rest.shape[-1] == 0 else torch.cat([rotated, rest], dim=-1)


class DistributedAttention(nn.Module):
    """Ulysses attention: all-to-all from sequence parts to head groups, `local_attention`, and back."""

    def __init__(self, local_attention: nn.Module, sequence_process_group: dist.ProcessGroup | None,
                 scatter_idx: int = 2, gather_idx: int = 0, sp_stream: Any = None, num_kv_heads: int | None = None):
        super().__init__()
        if scatter_idx != 2 or gather_idx not in (0, 1):
            raise UserError(f"DistributedAttention(scatter_idx={scatter_idx}, gather_idx={gather_idx}): heads must be "
                            f"at dim 2 of [s, b, h, d] or [b, s, h, d]; use scatter_idx=2, gather_idx=0 (the defaults)")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads
        self.comm = Comm(sequence_process_group, CommLedger(), name="sp")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int, rotary_pos_emb: Any = None,
                *args: Any, **kwargs: Any) -> Tensor:
        if batch_dim_idx not in (0, 1):
            raise UserError(f"DistributedAttention: batch_dim_idx = {batch_dim_idx}; use 0 ([b, s, h, d]) or 1 "
                            f"([s, b, h, d])")
        size = self.comm.size
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.shape[2] % size:
                raise UserError(f"DistributedAttention: {name} heads {t.shape[2]} are not divisible by the sequence "
                                f"parallel size {size}; use a size dividing the (key/value) head count")
        q, k, v = (_from_bhsd(SeqToHeads.apply(_to_bhsd(t, batch_dim_idx), self.comm), batch_dim_idx)
                   for t in (query, key, value))
        if rotary_pos_emb is not None:     # [b or 1, S, 1, rot] -> the layout of q: [S, b, 1, rot] sequence-first
            cos, sin = rotary_pos_emb[0].permute(1, 0, 2, 3), rotary_pos_emb[1].permute(1, 0, 2, 3)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        out: Tensor = HeadsToSeq.apply(_to_bhsd(context, batch_dim_idx), self.comm)
        return _from_bhsd(out, batch_dim_idx)
