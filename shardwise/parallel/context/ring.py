"""Ring attention: each context-parallel rank holds 1/C of the sequence's queries, keys and values; the keys and
values travel round the ring of cp ranks while each rank attends to the block it holds, and the partial results are
combined with an online softmax that carries each query row's log-sum-exp.

Forward, on rank r of C, with q [B, H, s, D] and k, v [B, Hkv, s, D] (s = S / C, Hkv divides H):

    round t = 0 .. C-1: this rank holds the key/value block of rank j = (r - t) mod C
        post: send the block to rank r+1, receive the next one from rank r-1 (one batched isend/irecv; every
              rank posts its pair every round but the last)
        attend: q against the held block -> (o_t, lse_t); merge into (o, lse):
                lse' = logaddexp(lse, lse_t);  o = o * exp(lse - lse') + o_t * exp(lse_t - lse')
        wait for the received block

Backward walks the same ring. dq stays home; the gradient of each key/value block travels with it: the block of
rank j collects rank j's contribution, then r+1's, ..., and a last send after round C-1 brings it home. That send
of round t overlaps the attention of round t+1 (each round adds the received partial sum to its own).

Causal, load-balanced (`layout.SequenceLayout`): rank r holds chunks (r, 2C-1-r) as [first half | second half].
Against the block of rank j:
    j = r   the local block under the causal mask (its positions increase along the local order)
    j < r   all queries against the block's first half (chunk j precedes both of r's chunks; chunk 2C-1-j
            follows both) -- the second half is skipped, wholly above the diagonal
    j > r   only the second half of the queries (chunk 2C-1-r) against the whole block; the first is skipped
So every round after the first costs half a block on every rank.

The arithmetic of one block is plain matmuls in fp32 (any device; no fused kernel needed on CPU), the scores of
one block at a time: memory O(s^2) per block, not O(S^2).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardwise.comm.collectives import Comm, Handle
from shardwise.parallel.context.layout import SequenceLayout


def _expand(x: Tensor, groups: int) -> Tensor:
    """Key/value heads [B, Hkv, s, D] -> [B, Hkv * groups, s, D]: each serves `groups` consecutive query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(grad: Tensor, groups: int) -> Tensor:
    """The gradient of `_expand`: [B, Hkv * groups, s, D] -> [B, Hkv, s, D], summed over each kv head's queries."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(dim=2)


def _causal_mask(rows: int, cols: int, device: torch.device) -> Tensor:
    """True where a query may not see a key: above the diagonal of a square (local) block."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).triu(1)


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    """q [B, H, m, D], k [B, H, n, D] (fp32) -> scaled scores [B, H, m, n], masked above the diagonal if causal."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return scores


def _block_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Attention of q over one key/value block: out [B, H, m, D] and lse [B, H, m], fp32."""
    scores = _scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's (out, lse) into the running ones, in place (rows given by the views passed)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _block_backward(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, scale: float,
                    causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block from the final softmax statistics (fp32): dq [B, H, m, D], dk, dv [B, H, n, D].
    p = exp(scores - lse) is the block's share of the full softmax; delta = rowsum(dout * out)."""
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, dk, dv


class _Ring:
    """The ring of one cp group: this rank sends to the next and receives from the previous."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.next = (comm.rank + 1) % comm.size
        self.prev = (comm.rank - 1) % comm.size

    def pass_on(self, tensor: Tensor) -> tuple[Tensor, list[Handle]]:
        """Post: send `tensor` to the next rank, receive its peer's into a new buffer (valid after the waits)."""
        received = torch.empty_like(tensor)
        handles = self.comm.batch_isend_irecv([(tensor, self.next)], [(received, self.prev)])
        return received, handles


def _wait(handles: list[Handle]) -> None:
    for h in handles:
        h.wait()


def _rows_and_keys(layout: SequenceLayout, step: int, causal: bool, s: int) -> tuple[slice, slice, bool]:
    """Which query rows attend to which keys of the block held at round `step`, and whether under the causal
    mask; the whole block without causality."""
    everything = slice(0, s)
    if not causal:
        return everything, everything, False
    source = (layout.rank - step) % layout.size
    half = s // 2
    if source == layout.rank:
        return everything, everything, True
    if source < layout.rank:
        return everything, slice(0, half), False
    return slice(half, s), everything, False


class RingAttentionFunction(torch.autograd.Function):
    """softmax(q k^T * scale [+ causal mask]) v over the whole sequence, each rank holding its part."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, comm: Comm, layout: SequenceLayout, causal: bool,
                scale: float) -> Tensor:
        groups = q.shape[1] // k.shape[1]
        ring = _Ring(comm)
        s = q.shape[-2]
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        block = torch.stack([k, v])                               # [2, B, Hkv, s, D]: one message per round
        for step in range(layout.size):
            pending = ring.pass_on(block) if step < layout.size - 1 else None
            rows, keys, masked = _rows_and_keys(layout, step, causal, s)
            kf = _expand(block[0].float(), groups)[:, :, keys]
            vf = _expand(block[1].float(), groups)[:, :, keys]
            block_out, block_lse = _block_forward(qf[:, :, rows], kf, vf, scale, masked)
            _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if pending is not None:
                _wait(pending[1])
                block = pending[0]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.layout, ctx.causal, ctx.scale = comm, layout, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        layout: SequenceLayout = ctx.layout
        groups = q.shape[1] // k.shape[1]
        ring = _Ring(ctx.comm)
        s = q.shape[-2]
        qf, doutf = q.float(), dout.float()
        delta = (doutf * out).sum(dim=-1)                         # [B, H, s]
        dq = torch.zeros_like(qf)
        block = torch.stack([k, v])
        travelling: tuple[Tensor, list[Handle]] | None = None     # the partial dk, dv of the block held next
        for step in range(layout.size):
            pending = ring.pass_on(block) if step < layout.size - 1 else None
            rows, keys, masked = _rows_and_keys(layout, step, ctx.causal, s)
            kf = _expand(block[0].float(), groups)[:, :, keys]
            vf = _expand(block[1].float(), groups)[:, :, keys]
            dq_rows, dk_keys, dv_keys = _block_backward(qf[:, :, rows], kf, vf, doutf[:, :, rows],
                                                        lse[:, :, rows], delta[:, :, rows], ctx.scale, masked)
            dq[:, :, rows] += dq_rows
            mine = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)   # [2, B, Hkv, s, D]
            mine[0][:, :, keys] = _fold(dk_keys, groups)
            mine[1][:, :, keys] = _fold(dv_keys, groups)
            if travelling is not None:                            # the sum of the ranks that held it before
                _wait(travelling[1])
                mine += travelling[0]
            travelling = ring.pass_on(mine)                       # on to the next holder; after the last round, home
            if pending is not None:
                _wait(pending[1])
                block = pending[0]
        assert travelling is not None
        _wait(travelling[1])
        dkv = travelling[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, comm: Comm, layout: SequenceLayout, causal: bool,
                   scale: float | None = None) -> Tensor:
    """This rank's attention output [B, H, s, D] for its queries q [B, H, s, D] over the whole sequence, whose keys
    and values k, v [B, Hkv, s, D] are spread over the cp ranks of `comm` as `layout` says."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")
    if causal and not layout.balanced:
        raise ValueError("causal ring attention needs the balanced layout (rank i holds chunks i and 2C-1-i)")
    if causal and q.shape[-2] % 2:
        raise ValueError(f"causal ring attention holds two equal chunks per rank; got {q.shape[-2]} local tokens")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out: Tensor = RingAttentionFunction.apply(q, k, v, comm, layout, causal, scale)
    return out
