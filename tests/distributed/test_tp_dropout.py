"""Dropout under tensor parallelism (2 gloo ranks, TP = 2).

Every process is seeded differently on purpose (as scripts that seed with the rank do). Then:
- replicated activations get the same masks on both TP ranks: the losses agree and the replicated
  parameters (norms, row-parallel biases), whose gradients are computed from replicated activations, stay
  identical after training steps, with and without sequence parallelism;
- split activations draw from each rank's own stream: inside `fork()` the ranks' numbers differ, the stream
  continues from call to call, and the default stream is left exactly where it was (equal on both ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.testing import run_distributed, tiny_gpt

SEQ = 16


def _train(sp: bool, positions: str) -> dict:
    import shardwise
    from shardwise.parallel.tensor_parallel.layers import is_tensor_parallel_shard
    model = tiny_gpt(seq_len=SEQ, dropout=0.2, positions=positions, seed=0)
    torch.manual_seed(1000 + dist.get_rank())                  # different streams per process
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "tensor_parallel": {"size": 2, "sequence_parallel": sp}}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(3):
        rows = torch.randint(0, 256, (4, SEQ + 1), generator=g)
        loss = engine((rows[:, :-1], rows[:, 1:]))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    replicated = {n: p.detach().clone() for n, p in engine.module.named_parameters() if not is_tensor_parallel_shard(p)}
    engine.close()
    return {"losses": losses, "replicated": replicated}


def _ranks() -> dict:
    from shardwise.comm.collectives import Comm
    from shardwise.comm.ledger import CommLedger
    from shardwise.parallel.tensor_parallel.random import TensorParallelRNG
    torch.set_num_threads(1)
    out = {f"sp={sp} {pos}": _train(sp, pos) for sp, pos in ((False, "learned"), (True, "learned"), (True, "rotary"))}
    torch.manual_seed(77 + dist.get_rank())
    rng = TensorParallelRNG(Comm(None, CommLedger(), name="tp"), torch.device("cpu"))
    before = torch.rand(3)
    with rng.fork():
        first = torch.rand(3)
    with rng.fork():
        second = torch.rand(3)
    after = torch.rand(3)
    out["rng"] = {"before": before, "after": after, "first": first, "second": second, "seed": rng.seed}
    return out


def test_dropout_masks_agree_where_replicated_and_differ_where_split() -> None:
    a, b = run_distributed(_ranks, 2, timeout=240)
    for case in ("sp=False learned", "sp=True learned", "sp=True rotary"):
        assert a[case]["losses"] == b[case]["losses"], f"{case}: TP ranks saw different replicated activations"
        assert a[case]["losses"][0] != a[case]["losses"][1]
        for name, value in a[case]["replicated"].items():
            torch.testing.assert_close(b[case]["replicated"][name], value, rtol=0, atol=0,
                                       msg=f"{case}: replicated {name} drifted apart across TP ranks")
    ra, rb = a["rng"], b["rng"]
    assert torch.equal(ra["before"], rb["before"]) and torch.equal(ra["after"], rb["after"])  # shared stream
    assert not torch.equal(ra["first"], rb["first"])                                        # own streams
    assert not torch.equal(ra["first"], ra["second"])                                       # continued
    assert rb["seed"] == ra["seed"] + 1
