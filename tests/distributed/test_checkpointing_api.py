"""A model written against DeepSpeed's `deepspeed.checkpointing` runs with shardwise in its place, and the
engine's DeepSpeed activation-checkpointing keys work: all exact against the run without recomputation.

`ds_model(ds)` is the model a Megatron-DeepSpeed style script writes, with `ds` the module it imported as
`deepspeed`: each layer's body goes through `ds.checkpointing.checkpoint`, and a dropout on "split" activations
draws from `ds.checkpointing.get_cuda_rng_tracker().fork()`. It runs under shardwise and under DeepSpeed itself
(DS_ACCELERATOR=cpu) on the same data from the same seed."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.testing import micro_steps, run_distributed, tiny_gpt, token_batches

WIDTH, STEPS, ROWS = 16, 3, 4


class _Layer(nn.Module):
    def __init__(self, ds, recompute: bool):
        super().__init__()
        self.ds, self.recompute = ds, recompute
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        with self.ds.checkpointing.get_cuda_rng_tracker().fork():     # the model-parallel stream
            h = torch.nn.functional.dropout(h, 0.2, self.training)
        return x + torch.nn.functional.dropout(self.fc2(h), 0.1, self.training)    # the default stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ds.checkpointing.checkpoint(self.body, x) if self.recompute else self.body(x)


class _Net(nn.Module):
    def __init__(self, ds, recompute: bool):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(_Layer(ds, recompute) for _ in range(3))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def ds_model(ds, recompute: bool) -> nn.Module:
    torch.manual_seed(0)
    return _Net(ds, recompute)


def _train(use: str, recompute: bool, policy: str = "none") -> list[float]:
    if use == "deepspeed":
        os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed as ds
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False     # no JIT build of an unused kernel
        deepspeed.utils.logger.setLevel(logging.WARNING)
        ds.init_distributed(dist_backend="gloo")                            # joins the group the test made
    else:
        import shardwise as ds
    ds.checkpointing.configure(None, partition_activations=False)
    tracker = ds.checkpointing.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 1234 + 2718)
    model = ds_model(ds, recompute)
    cfg = {"train_batch_size": ROWS * dist.get_world_size(), "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    if policy != "none":
        cfg["activation_checkpointing"] = {"policy": policy}
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    torch.manual_seed(99 + dist.get_rank())
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(ROWS * dist.get_world_size(), WIDTH, generator=g)
        mine = x[ROWS * dist.get_rank():ROWS * (dist.get_rank() + 1)]
        loss = engine(mine).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _three_runs() -> dict:
    return {"shardwise": _train("shardwise", True), "plain": _train("shardwise", False),
            "policy": _train("shardwise", False, policy="full"), "deepspeed": _train("deepspeed", True)}


def test_a_deepspeed_checkpointing_model_runs_with_the_import_changed():
    for runs in run_distributed(_three_runs, 2):
        assert runs["shardwise"] == runs["plain"]                 # recomputation replays both streams exactly
        assert runs["policy"] == runs["plain"]                    # so does the engine's policy (tracker rewound)
        torch.testing.assert_close(runs["shardwise"], runs["deepspeed"], rtol=1e-5, atol=0)


def _keys(extra: dict) -> dict:
    import shardwise
    from shardwise.checkpointing import profile_times
    model = tiny_gpt(n_layer=2, seq_len=16, dropout=0.1)
    torch.manual_seed(5 + dist.get_rank())
    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "tensor_parallel": {"size": 2},
           "activation_checkpointing": extra}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    profile_times()
    losses = [float(engine.train_batch(iter(m)))
              for m in micro_steps(token_batches(STEPS, 2, 17, seed=8), grad_accum=1)]
    return {"losses": losses, "state": engine.consolidated_state_dict(), "times": profile_times(),
            "activations": engine.memory_report()["activations"]}


def _all_keys() -> dict:
    return {"none": _keys({"policy": "none"}), "full": _keys({"policy": "full"}),
            "partitioned": _keys({"policy": "full", "partition_activations": True}),
            "host": _keys({"policy": "full", "cpu_checkpointing": True, "profile": True,
                           "synchronize_checkpoint_boundary": True})}


def test_deepspeed_keys_under_tp_are_exact_and_partitioning_halves_the_stored_inputs():
    results = run_distributed(_all_keys, 2)
    for rank, runs in enumerate(results):
        for name in ("full", "partitioned", "host"):
            assert runs[name]["losses"] == runs["none"]["losses"], (name, rank)
            if rank == 0:
                for k, v in runs["none"]["state"].items():
                    assert torch.equal(runs[name]["state"][k], v), (name, k)
        # each block keeps its [b, s, h] input: whole on each TP rank, or half of it when partitioned
        per_block = 2 * 16 * 32 * 4
        assert runs["full"]["activations"] - runs["partitioned"]["activations"] == 2 * per_block // 2, runs
        phases = [p for p, _ in runs["host"]["times"]]
        assert phases.count("forward") == phases.count("replay") == 2 * STEPS       # 2 blocks per step
        assert runs["full"]["times"] == []                                          # profile off


@pytest.mark.parametrize("block", [{"contiguous_memory_optimization": True}])
def test_contiguous_checkpointing_needs_its_companions(block):
    from shardwise import checkpointing
    with pytest.raises(ValueError, match="partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="number_checkpoints"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.warns(UserWarning, match="no effect"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4)
    assert checkpointing.is_configured()
