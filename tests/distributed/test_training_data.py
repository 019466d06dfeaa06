"""`shardwise.initialize(training_data=...)` then `engine.train_batch()` without an iterator, as DeepSpeed's
pipeline examples train, here without a pipeline (dp = 2): the engine reads its DistributedSampler loader,
restarted (and reshuffled) at its end, and equals the single-process reference on the same samples;
`engine.set_dataiterator` takes over."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.testing import assert_close_lists, assert_state_close, reference_train, run_distributed, tiny_gpt

SEQ, MICRO, DP, GAS = 8, 2, 2, 2


def dataset() -> list[tuple]:
    """10 samples: 5 per dp rank, so 2 micro-batches of 2 per epoch (the loader drops the fifth)."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 256, (10, SEQ + 1), generator=g)
    return [(r[:-1], r[1:]) for r in rows]


def _train() -> dict:
    import shardwise
    torch.set_num_threads(1)
    model = tiny_gpt(seq_len=SEQ)
    config = {"train_batch_size": MICRO * GAS * DP, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}
    engine, _, loader, _ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=dataset())
    losses = [engine.train_batch() for _ in range(3)]     # 3 epochs: each step is one epoch here
    fixed = next(iter(loader))                           # then an iterator of our own takes over
    engine.set_dataiterator(iter([fixed] * GAS))
    losses.append(engine.train_batch())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # DeepSpeed hands the loss back as a tensor: scripts call .item() on it
    as_deepspeed = all(torch.is_tensor(x) and x.dim() == 0 and isinstance(x.item(), float) for x in losses)
    return {"losses": [float(x) for x in losses], "state": state, "rank": dist.get_rank(), "fixed": fixed,
            "as_deepspeed": as_deepspeed}


def test_train_batch_reads_the_training_data_and_set_dataiterator():
    from torch.utils.data.distributed import DistributedSampler
    results = run_distributed(_train, DP, timeout=180)
    data = dataset()
    steps = []
    for epoch in range(3):
        batches = []
        for r in range(DP):
            sampler = DistributedSampler(data, num_replicas=DP, rank=r)
            sampler.set_epoch(epoch)
            order = list(sampler)[:MICRO * GAS]
            batches.append([[data[i] for i in order[k:k + MICRO]] for k in range(0, MICRO * GAS, MICRO)])
        # micro-step k: both ranks' k-th micro-batch (the dp mean of equal batches is the mean of their union)
        steps.append([(torch.stack([x for r in range(DP) for x, _ in batches[r][k]]),
                       torch.stack([y for r in range(DP) for _, y in batches[r][k]])) for k in range(GAS)])
    fixed = [results[r]["fixed"] for r in range(DP)]
    steps.append([(torch.cat([f[0] for f in fixed]), torch.cat([f[1] for f in fixed]))] * GAS)
    model = tiny_gpt(seq_len=SEQ)
    ref = reference_train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), steps,
                          loss_fn=lambda mod, mb: mod(*mb))
    for res in results:
        assert res["as_deepspeed"], "train_batch must return a 0-dim tensor, as DeepSpeed does"
        assert_close_lists(res["losses"], ref, rtol=1e-5, atol=1e-6, what=f"rank {res['rank']} losses")
        assert_state_close(res["state"], model.state_dict(), what=f"rank {res['rank']}")


# ----- a DeepSpeed pipeline script, imports changed: shardwise.pipe.PipelineModule + training_data -----

def ds_style_net() -> torch.nn.Module:
    """DeepSpeed's pipeline example in small: LayerSpecs (each under its own seed), modules and a lambda, a
    classification loss, 2 stages cut by parameter counts."""
    from torch import nn

    from shardwise.pipe import LayerSpec, PipelineModule
    layers = [LayerSpec(nn.Linear, 12, 16), nn.Tanh(), lambda x: x * 0.5, LayerSpec(nn.Linear, 16, 16), nn.Tanh(),
              LayerSpec(nn.Linear, 16, 4)]
    torch.manual_seed(99)    # the plain modules' (none have parameters here) and everything else's seed
    return PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2, partition_method="parameters",
                          seed_layers=True)


def classes() -> list[tuple]:
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)
    return [(x[i], y[i]) for i in range(16)]


DS_CONFIG = {"train_batch_size": MICRO * GAS * DP, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
             "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000}   # no "pipeline" block


def _ds_style() -> dict:
    import shardwise
    torch.set_num_threads(1)
    net = ds_style_net()
    engine, _, _, _ = shardwise.initialize(model=net, model_parameters=[p for p in net.parameters()
                                                                        if p.requires_grad],
                                           config=DS_CONFIG, training_data=classes())
    losses = [engine.train_batch() for _ in range(3)]
    out = {"losses": losses, "state": engine.consolidated_state_dict(), "stages": engine.pipeline.stage.num_stages,
           "partition": engine.config.pipeline.partition.value, "schedule": engine.config.pipeline.schedule.value}
    engine.close()
    out["deepspeed"] = _deepspeed_losses()
    return out


def _deepspeed_losses() -> list[float]:
    """The same script under DeepSpeed itself (deepspeed.pipe, CPU, gloo). Its seed_layers fails on Python 3.11
    (random.seed of a non-int) and each stage builds only its own layers, so its weights are copied from the full
    model built as above."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from torch import nn
    deepspeed.init_distributed(dist_backend="gloo")     # joins the process group already there
    layers = [LayerSpec(nn.Linear, 12, 16), nn.Tanh(), lambda x: x * 0.5, LayerSpec(nn.Linear, 16, 16), nn.Tanh(),
              LayerSpec(nn.Linear, 16, 4)]
    net = PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2, partition_method="parameters")
    full = ds_style_net()
    with torch.no_grad():
        for name, p in net.named_parameters():          # "<layer index>.<parameter>"
            index, rest = name.split(".", 1)
            p.copy_(full.layers[int(index)].get_parameter(rest))
    # Its own training_data loader starts worker processes, which a test's daemonic rank cannot: the same
    # unshuffled DistributedSampler order, repeated, goes in as data_iter instead.
    from deepspeed.utils import RepeatingLoader
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()
                                                                        if p.requires_grad], config=DS_CONFIG)
    sampler = DistributedSampler(classes(), num_replicas=DP, rank=engine.grid.get_data_parallel_rank(),
                                 shuffle=False)
    data = iter(RepeatingLoader(DataLoader(classes(), batch_size=MICRO, sampler=sampler, drop_last=True)))
    return [float(engine.train_batch(data_iter=data)) for _ in range(3)]


def test_deepspeed_pipeline_module_script_equals_reference_and_deepspeed():
    from torch.utils.data.distributed import DistributedSampler
    results = run_distributed(_ds_style, 4, timeout=180)
    data = classes()
    orders = []
    for epoch in range(2):   # in order under a pipeline, as DeepSpeed's PipelineEngine reads
        for r in range(DP):
            orders.append((epoch, r, list(DistributedSampler(data, num_replicas=DP, rank=r, shuffle=False))))
    # per dp rank: its micro-batches in order over epochs (4 per epoch: 8 samples / 2)
    per_rank = {r: [o[k:k + MICRO] for e, rr, o in orders if rr == r for k in range(0, len(o), MICRO)]
                for r in range(DP)}
    micro = [(torch.stack([data[i][0] for r in range(DP) for i in per_rank[r][k]]),
              torch.stack([data[i][1] for r in range(DP) for i in per_rank[r][k]])) for k in range(3 * GAS)]
    net = ds_style_net()
    ref = reference_train(net, torch.optim.SGD(net.parameters(), lr=0.1),
                          [micro[k:k + GAS] for k in range(0, 3 * GAS, GAS)], loss_fn=lambda mod, mb: mod(*mb))
    for rank, res in enumerate(results):
        assert (res["stages"], res["partition"], res["schedule"]) == (2, "parameters", "1f1b")
        assert_close_lists(res["losses"], ref, rtol=1e-5, atol=1e-6, what=f"rank {rank} losses")
        assert_close_lists(res["losses"], res["deepspeed"], rtol=1e-5, atol=1e-6, what=f"rank {rank} vs DeepSpeed")
    assert_state_close(results[0]["state"], net.state_dict(), what="after 3 train_batch() steps")
