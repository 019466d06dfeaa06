"""What DeepSpeed's scripts read off ZeRO-3 parameters and the engine, in one process (a world of one, CPU):

- `zero.Init` shards every parameter, small ones too: outside `GatheredParameters` each is 0-sized and its
  `ds_status` NOT_AVAILABLE; inside, whole and AVAILABLE; a launched gather shows INFLIGHT. `ds_numel`,
  `ds_shape`, `ds_tensor`, `ds_id`, `ds_persist` describe it; a module built outside the block has none of them.
- `initialize` keeps the parameters under the config's persistence threshold whole (`ds_persist`, AVAILABLE) and
  trains bit for bit as the same model built without the block.
- `engine.tput_timer` counts micro and global steps as DeepSpeed's ThroughputTimer.
- A config's "Adam" / "AdamW" is a `shardwise.ops.adam.FusedAdam` (DeepSpeed's class); "torch_adam" is torch's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.comm.collectives import COLLECTIVES_AT_ONE_ENV

# initialize() and zero.Init make a world of one in this process: torn down after this file (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_world_left_behind")

THRESHOLD = 20          # stage3_param_persistence_threshold: the biases (4 elements) stay whole, the weights not
ZERO3 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": THRESHOLD}}


@pytest.fixture(autouse=True)
def _one_cpu_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_DEVICE", "cpu")
    monkeypatch.setenv(COLLECTIVES_AT_ONE_ENV, "1")


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return ((self.head(x) - y) ** 2).mean()


def _built_in_init() -> Blocks:
    from shardwise import zero
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=ZERO3):
        return Blocks()


def test_zero_init_parameters_carry_deepspeed_status_and_go_back_to_0_sized() -> None:
    from shardwise.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus
    torch.manual_seed(0)
    whole = {n: p.detach().clone() for n, p in Blocks().named_parameters()}
    model = _built_in_init()
    named = dict(model.named_parameters())
    ids = [p.ds_id for p in named.values()]
    assert len(set(ids)) == len(ids) and all(isinstance(i, int) for i in ids)
    for name, p in named.items():
        # every parameter, the 1-element head bias too: the persistence threshold is initialize's to apply
        assert p.numel() == 0 and p.ds_status == ZeroParamStatus.NOT_AVAILABLE, name
        assert (p.ds_numel, p.ds_shape, p.ds_persist) == (whole[name].numel(), whole[name].shape, False), name
        assert torch.equal(p.ds_tensor, whole[name].reshape(-1)), name      # one rank: its piece is all of it
    with GatheredParameters(list(named.values()), modifier_rank=0):
        for name, p in named.items():
            assert p.ds_status == ZeroParamStatus.AVAILABLE and torch.equal(p, whole[name]), name
        with torch.no_grad():
            model.head.weight.fill_(2.0)
    for name, p in named.items():
        assert p.numel() == 0 and p.ds_status == ZeroParamStatus.NOT_AVAILABLE, name
    with GatheredParameters(model.head.weight):
        assert torch.equal(model.head.weight, torch.full((1, 4), 2.0))      # the change was kept
    assert not hasattr(nn.Linear(2, 2).weight, "ds_status")                 # built outside the block


def test_a_launched_gather_is_inflight() -> None:
    from shardwise.parallel.zero.gathered import LOCATION_ATTR
    from shardwise.runtime.zero.partition_parameters import ZeroParamStatus
    model = _built_in_init()
    at = getattr(model.layers[0].weight, LOCATION_ATTR)
    at.unit.start_gather(at.comm)
    assert model.layers[0].weight.ds_status == ZeroParamStatus.INFLIGHT
    at.unit.finish_gather()
    assert model.layers[0].weight.ds_status == ZeroParamStatus.AVAILABLE
    at.unit.free()
    assert model.layers[0].weight.ds_status == ZeroParamStatus.NOT_AVAILABLE


def _train(model: nn.Module, config: dict) -> tuple[list[float], object]:
    import shardwise
    engine, optimizer, *_ = shardwise.initialize(model=model, config=config)
    dtype = next(p.dtype for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        loss = engine(torch.randn(2, 4, generator=g).to(dtype), torch.randn(2, 1, generator=g).to(dtype))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, engine


@pytest.mark.parametrize("bf16", [False, True])
def test_initialize_keeps_the_small_parameters_whole_and_trains_as_without_zero_init(bf16: bool) -> None:
    from shardwise.ops.adam import FusedAdam
    from shardwise.runtime.zero.partition_parameters import ZeroParamStatus
    config = {**ZERO3, "bf16": {"enabled": bf16}}
    torch.manual_seed(0)
    expected, reference = _train(Blocks(), config)
    model = _built_in_init()
    losses, engine = _train(model, config)
    assert losses == expected                       # same units, same arithmetic: bit for bit
    for name, p in model.named_parameters():
        assert p.dtype == (torch.bfloat16 if bf16 else torch.float32), name     # the kept-whole ones too
        small = p.ds_numel <= THRESHOLD
        assert p.ds_persist == small and p.ds_status == (ZeroParamStatus.AVAILABLE if small
                                                         else ZeroParamStatus.NOT_AVAILABLE), name
        assert p.numel() == (p.ds_numel if small else 0), name
    assert isinstance(engine.optimizer, FusedAdam)       # the config's "Adam" is DeepSpeed's class
    engine.close()
    reference.close()


def test_config_adam_is_fused_adam_and_torch_adam_is_torch_class() -> None:
    import shardwise
    from shardwise.ops.adam import FusedAdam
    for kind, params, cls in (("Adam", {}, FusedAdam), ("AdamW", {}, FusedAdam),
                              ("AdamW", {"torch_adam": True}, torch.optim.AdamW),
                              ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam)):
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": kind, "params": params}}
        engine, optimizer, *_ = shardwise.initialize(model=nn.Linear(2, 2), config=config)
        assert isinstance(optimizer, cls) and isinstance(engine.optimizer, cls), (kind, params)
        assert cls is not FusedAdam or not isinstance(optimizer, torch.optim.AdamW)
        engine.close()


def test_throughput_timer_counts_as_deepspeeds() -> None:
    import shardwise
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = shardwise.initialize(model=nn.Linear(2, 1), config=config)
    timer = engine.tput_timer
    assert timer.batch_size == 6 and timer.start_step == 2
    assert (timer.initialized, timer.started, timer.start_time, timer.total_elapsed_time) == (False, False, 0, 0)
    timer.stop()                                     # never started: nothing counted
    assert (timer.micro_step_count, timer.global_step_count) == (0, 0)
    for micro in range(1, 9):                       # 8 micro-batches, 4 global steps
        engine.backward(engine(torch.ones(3, 2)).sum())
        engine.step()
        assert timer.initialized and not timer.started
        assert (timer.micro_step_count, timer.global_step_count) == (micro, micro // 2)
        # the first start_step global steps are not timed
        assert (timer.total_elapsed_time > 0) == (micro > 2 * timer.start_step)
    assert timer.avg_samples_per_sec() > 0
    engine.close()
