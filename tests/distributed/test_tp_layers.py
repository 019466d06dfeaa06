"""Each tensor-parallel layer alone equals the full layer it was cut from: forward output, input gradient and
weight gradients (gathered), fp32, at T = 2 (two groups of a 4-rank world, so group ranks differ from world
ranks) and T = 4; with and without sequence parallelism; plus the vocabulary-parallel cross-entropy and the
communication each layer records."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.testing import run_distributed

B, S, IN, OUT, VOCAB = 2, 8, 8, 12, 16
TOL = dict(rtol=1e-5, atol=1e-6)


def _tp_group(t: int):
    """This rank's TP group for size t; T=2 uses groups {0,1} and {2,3} (every rank creates both)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if t == world:
        return None
    mine = None
    for start in range(0, world, t):
        g = dist.new_group(list(range(start, start + t)))
        if start <= rank < start + t:
            mine = g
    return mine


def _chunk(x: torch.Tensor, dim: int, comm) -> torch.Tensor:
    return x.chunk(comm.size, dim=dim)[comm.rank]


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _collectives(comm) -> list[tuple[str, int]]:
    return [(r.op, r.nbytes) for r in comm.ledger.records]


def _close(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _check_column(comm, gather_output: bool, sp: bool) -> list:
    from shardwise.parallel.tensor_parallel import ColumnParallelLinear
    torch.manual_seed(0)
    full = torch.nn.Linear(IN, OUT)
    x = torch.randn(B, S, IN)
    w = torch.randn(B, S, OUT)                                   # loss weights: loss = sum(y * w)
    xf = _leaf(x)
    (full(xf) * w).sum().backward()
    layer = ColumnParallelLinear(full, comm, gather_output=gather_output, sequence_parallel=sp)
    xl = _leaf(_chunk(x, 1, comm) if sp else x)
    y = layer(xl)
    what = f"column t={comm.size} gather={gather_output} sp={sp}"
    if gather_output:
        _close(y, full(x), what + " output")
        (y * w).sum().backward()                                 # every rank holds the whole loss
    else:
        _close(y, _chunk(full(x), -1, comm), what + " output")
        (y * _chunk(w, -1, comm)).sum().backward()               # the ranks' losses sum to the whole loss
    _close(xl.grad, _chunk(xf.grad, 1, comm) if sp else xf.grad, what + " input grad")
    _close(layer.weight.grad, _chunk(full.weight.grad, 0, comm), what + " weight grad")
    _close(layer.bias.grad, _chunk(full.bias.grad, 0, comm), what + " bias grad")
    return _collectives(comm)


def _check_row(comm, input_is_parallel: bool, sp: bool) -> list:
    from shardwise.parallel.tensor_parallel import RowParallelLinear
    torch.manual_seed(1)
    full = torch.nn.Linear(IN, OUT)
    x = torch.randn(B, S, IN)
    w = torch.randn(B, S, OUT)
    xf = _leaf(x)
    (full(xf) * w).sum().backward()
    layer = RowParallelLinear(full, comm, input_is_parallel=input_is_parallel, sequence_parallel=sp)
    xl = _leaf(_chunk(x, -1, comm) if input_is_parallel else x)
    y = layer(xl)
    what = f"row t={comm.size} parallel_in={input_is_parallel} sp={sp}"
    if sp:
        _close(y, _chunk(full(x), 1, comm), what + " output")
        (y * _chunk(w, 1, comm)).sum().backward()
    else:
        _close(y, full(x), what + " output")
        (y * w).sum().backward()
    _close(xl.grad, _chunk(xf.grad, -1, comm) if input_is_parallel else xf.grad, what + " input grad")
    _close(layer.weight.grad, _chunk(full.weight.grad, 1, comm), what + " weight grad")
    _close(layer.bias.grad, full.bias.grad, what + " bias grad")
    return _collectives(comm)


def _check_embedding(comm, sp: bool) -> list:
    from shardwise.parallel.tensor_parallel import VocabParallelEmbedding
    torch.manual_seed(2)
    full = torch.nn.Embedding(VOCAB, IN, padding_idx=VOCAB - 3)   # the padding row lives on the last rank
    ids = torch.randint(0, VOCAB, (B, S))
    ids[0, :3] = VOCAB - 3
    w = torch.randn(B, S, IN)
    (full(ids) * w).sum().backward()
    layer = VocabParallelEmbedding(full, comm, sequence_parallel=sp)
    y = layer(ids)
    what = f"embedding t={comm.size} sp={sp}"
    if sp:
        _close(y, _chunk(full(ids), 1, comm), what + " output")
        (y * _chunk(w, 1, comm)).sum().backward()
    else:
        _close(y, full(ids), what + " output")
        (y * w).sum().backward()
    _close(layer.weight.grad, _chunk(full.weight.grad, 0, comm), what + " weight grad")
    return _collectives(comm)


def _check_loss(comm) -> list:
    from shardwise.parallel.tensor_parallel import vocab_parallel_cross_entropy
    torch.manual_seed(3)
    logits = torch.randn(B, S, VOCAB) * 3
    labels = torch.randint(0, VOCAB, (B, S))
    labels[1, ::3] = -100
    lf = _leaf(logits)
    ref = F.cross_entropy(lf.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    ref.backward()
    ll = _leaf(_chunk(logits, -1, comm))
    loss = vocab_parallel_cross_entropy(ll, labels, comm)
    _close(loss, ref.detach(), f"loss t={comm.size}")
    loss.backward()
    _close(ll.grad, _chunk(lf.grad, -1, comm), f"loss t={comm.size} logits grad")
    return _collectives(comm)


def _all_layers() -> dict:
    torch.set_num_threads(1)
    out = {}
    from shardwise.comm import Comm, CommLedger
    for t in (2, 4):
        group = _tp_group(t)

        def fresh():                      # a new ledger per case: each case's traffic is checked alone
            return Comm(group, CommLedger(), name="tp")
        for g in (False, True):
            for sp in (False, True):
                out[f"col t={t} gather={g} sp={sp}"] = _check_column(fresh(), g, sp)
        for p, sp in ((True, False), (False, False), (True, True)):
            out[f"row t={t} parallel={p} sp={sp}"] = _check_row(fresh(), p, sp)
        for sp in (False, True):
            out[f"emb t={t} sp={sp}"] = _check_embedding(fresh(), sp)
        out[f"loss t={t}"] = _check_loss(fresh())
    return out


def test_tp_layers_equal_full_layers_and_record_megatron_traffic():
    results = run_distributed(_all_layers, 4, timeout=240)
    f32 = 4
    act_in, act_out, act_emb = B * S * IN * f32, B * S * OUT * f32, B * S * IN * f32
    for res in results:
        for t in (2, 4):
            # column: the input enters the region (all-reduce of its gradient backward), or with SP is
            # all-gathered forward, gathered again backward for the weight gradient (only the shard is kept,
            # as Megatron does) and its gradient reduce-scattered; gather_output adds an all-gather
            assert res[f"col t={t} gather=False sp=False"] == [("all_reduce", act_in)]
            assert res[f"col t={t} gather=False sp=True"] == [("all_gather", act_in), ("all_gather", act_in),
                                                               ("reduce_scatter", act_in)]
            assert res[f"col t={t} gather=True sp=False"] == [("all_gather", act_out), ("all_reduce", act_in)]
            # row: one all-reduce of the output forward (identity backward), or reduce-scatter / all-gather
            assert res[f"row t={t} parallel=True sp=False"] == [("all_reduce", act_out)]
            assert res[f"row t={t} parallel=False sp=False"] == [("all_reduce", act_out), ("all_gather", act_in)]
            # (+ the replicated bias' gradient, summed once: each rank added it to its own tokens only)
            assert sorted(res[f"row t={t} parallel=True sp=True"]) == sorted(
                [("reduce_scatter", act_out), ("all_gather", act_out), ("all_reduce", OUT * f32)])
            assert res[f"emb t={t} sp=False"] == [("all_reduce", act_emb)]
            assert res[f"emb t={t} sp=True"] == [("reduce_scatter", act_emb), ("all_gather", act_emb)]
            # the loss: a max over N = b*s tokens, then sum-exp and target logit together; never the logits
            assert res[f"loss t={t}"] == [("all_reduce", B * S * f32), ("all_reduce", 2 * B * S * f32)]
