"""Expert parallelism's token exchange: each rank's routed tokens go to the ranks holding their experts, the
experts run, and the results come back to the token they belong to, in the exact order they left.

With E experts over an ep group of P ranks, rank r holds experts [r * E/P, (r + 1) * E/P). On each rank:

    choices [S * k] sorted by expert (stable)          -> sent rows [N, H], grouped by destination rank, then expert
    counts [E] --all-to-all--> counts received [P, E/P] (what each source rank sends to each local expert)
    sent rows --all-to-all (variable splits)--> received [R, H], grouped by source rank, then local expert
    each local expert runs once on all its rows        -> outputs [R, H] in the received order
    outputs --all-to-all (splits swapped)--> back [N, H] in the sent order -> weighted, added into y [S, H]

Both all-to-alls are autograd functions whose backward is the same exchange with the splits swapped, so the
gradients of the tokens and of the routing weights flow back to the ranks that routed them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from shardwise.comm.collectives import Comm
from shardwise.parallel.experts.router import Routing


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send), ...] out in runs of `send[j]` to rank j, rows [sum(recv), ...] in; backward the reverse."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm, send: list[int], recv: list[int]) -> Tensor:
        ctx.comm, ctx.send, ctx.recv = comm, send, recv
        out = x.new_empty((sum(recv), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), output_splits=recv, input_splits=send)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        ctx.comm.all_to_all_single(out, grad.contiguous(), output_splits=ctx.send, input_splits=ctx.recv)
        return out, None, None, None


def _exchange(x: Tensor, comm: Comm, send: list[int], recv: list[int]) -> Tensor:
    if comm.local:
        return x
    out: Tensor = _AllToAll.apply(x, comm, send, recv)
    return out


def _run_expert(expert: nn.Module, rows: Tensor) -> Tensor:
    out = expert(rows)
    return out[0] if isinstance(out, tuple) else out       # DeepSpeed's experts may return (output, bias)


def dispatch_and_combine(x: Tensor, routing: Routing, experts: Sequence[nn.Module], comm: Comm,
                         num_experts: int) -> Tensor:
    """y [S, H]: sum over token s's kept choices j of weight[s, j] * expert[s, j](x[s]), the experts being this
    rank's `experts` (the ep group's rank r holds global experts r * len(experts) onwards) and the other ep ranks'."""
    num_tokens, k = routing.expert.shape
    ep = comm.size
    per_rank = len(experts)
    # Dropped choices get the key E: sorted after every expert and never sent.
    key = torch.where(routing.kept, routing.expert, num_experts).reshape(-1)                 # [S * k]
    order = key.argsort(stable=True)                                                         # [S * k]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]                                                            # [E] kept choices
    received_counts = torch.empty_like(counts)
    comm.all_to_all_single(received_counts, counts)                                         # [P * E/P]
    # The one host read of the layer: all_to_all_single takes its split sizes as Python ints (NCCL sizes its
    # buffers and posts its sends from the host), and the experts' row counts size their inputs. Both count
    # vectors come over in one copy; nothing else here reads the device.
    host = torch.cat([counts, received_counts]).tolist()
    sent_per_expert, received_per_chunk = host[:num_experts], host[num_experts:]
    send = [sum(sent_per_expert[j * per_rank:(j + 1) * per_rank]) for j in range(ep)]
    recv = [sum(received_per_chunk[j * per_rank:(j + 1) * per_rank]) for j in range(ep)]
    kept_choices = order[:sum(send)]                                                         # [N]
    token = kept_choices // k                                                                # [N]
    received = _exchange(x.index_select(0, token), comm, send, recv)                         # [R, H]

    # received holds chunks (source rank j, local expert e) in that order; each expert runs once on its rows.
    chunks = list(received.split(received_per_chunk))
    outputs: list[Tensor | None] = [None] * len(chunks)
    for e, expert in enumerate(experts):
        mine = [j * per_rank + e for j in range(ep)]
        rows = chunks[mine[0]] if ep == 1 else torch.cat([chunks[c] for c in mine])
        result = _run_expert(expert, rows)
        for c, piece in zip(mine, result.split([received_per_chunk[c] for c in mine])):
            outputs[c] = piece
    expert_out = torch.cat([o for o in outputs if o is not None]) if chunks else received
    back = _exchange(expert_out, comm, recv, send)                                           # [N, H]
    weight = routing.weight.reshape(-1).index_select(0, kept_choices)                        # [N] fp32
    y = torch.zeros_like(x)
    return y.index_add(0, token, back * weight.unsqueeze(-1).to(back.dtype))
