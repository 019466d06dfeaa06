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

Each block runs through a fused attention kernel that returns the log-sum-exp (`blocks.block_kernel`: torch's
CPU flash attention, CUDA flash or memory-efficient attention; plain fp32 matmuls where none applies); its backward
is handed the merged output and log-sum-exp, so it recomputes the block's probabilities against the global
normalizer. Running output and log-sum-exp stay fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardwise.comm.collectives import Comm, Handle
from shardwise.parallel.context.blocks import block_kernel
from shardwise.parallel.context.layout import SequenceLayout


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's (out, lse) into the running ones, in place (rows given by the views passed)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


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
        kernel = block_kernel(q)
        ring = _Ring(comm)
        s = q.shape[-2]
        qc = q.to(kernel.dtype)
        # [B, H, s, D], merged in fp32, laid out as q is: a q viewed from [B, s, H, D] gives an output the model
        # reshapes back to [B, s, H * D] without a copy (which its output projection would store again).
        out = torch.empty_like(q, dtype=torch.float32)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)     # [B, H, s]
        block = torch.stack([k, v])                               # [2, B, Hkv, s, D]: one message per round
        for step in range(layout.size):
            pending = ring.pass_on(block) if step < layout.size - 1 else None
            rows, keys, masked = _rows_and_keys(layout, step, causal, s)
            kc, vc = (block[i][:, :, keys].to(kernel.dtype) for i in (0, 1))
            block_out, block_lse = kernel.forward(qc[:, :, rows], kc, vc, scale, masked)
            if step == 0:                                         # the local block: every row, nothing to merge
                out.copy_(block_out)
                lse.copy_(block_lse)
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out.float(), block_lse)
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
        kernel = block_kernel(q)
        ring = _Ring(ctx.comm)
        s = q.shape[-2]
        # Every block's backward gets the final output and lse of its rows: its probabilities against the global
        # normalizer, and delta = rowsum(dout * out) of the whole attention.
        qc, doutc, outc = q.to(kernel.dtype), dout.to(kernel.dtype), out.to(kernel.dtype)
        dq = torch.zeros_like(q, dtype=torch.float32)
        block = torch.stack([k, v])
        travelling: tuple[Tensor, list[Handle]] | None = None     # the partial dk, dv of the block held next
        for step in range(layout.size):
            pending = ring.pass_on(block) if step < layout.size - 1 else None
            rows, keys, masked = _rows_and_keys(layout, step, ctx.causal, s)
            kc, vc = (block[i][:, :, keys].to(kernel.dtype) for i in (0, 1))
            dq_rows, dk_keys, dv_keys = kernel.backward(doutc[:, :, rows], qc[:, :, rows], kc, vc,
                                                        outc[:, :, rows], lse[:, :, rows], ctx.scale, masked)
            dq[:, :, rows] += dq_rows
            mine = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)   # [2, B, Hkv, s, D]
            mine[0][:, :, keys] = dk_keys
            mine[1][:, :, keys] = dv_keys
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
