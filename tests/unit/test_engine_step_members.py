"""The engine's step in one process (SHARDWISE_DEVICE=cpu, collectives run at world 1 so the ledger records them):
grad mode, not the module's train/eval mode, makes a forward part of a training step; and `engine.optimizer`
answers what Accelerate and Hugging Face's Trainer read of DeepSpeed's optimizer wrapper (`overflow`,
`cur_scale`, `loss_scale`) while it stays the torch optimizer that steps."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm.collectives import COLLECTIVES_AT_ONE_ENV
from shardwise.ops.adam import FusedAdam
from shardwise.testing import lm_pair, tiny_gpt, token_batches

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}


@pytest.fixture(autouse=True)
def _one_cpu_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_DEVICE", "cpu")
    monkeypatch.setenv(COLLECTIVES_AT_ONE_ENV, "1")


# initialize() here makes a world of one in this process: torn down after this file (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_world_left_behind")


def _steps(engine, count: int) -> list[float]:
    batches = [lm_pair(b) for b in token_batches(2 * count, 2, 17, seed=5)]
    losses = []
    for inputs, labels in batches:
        loss = engine(inputs, labels)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _run(train_mode: bool) -> dict:
    import shardwise
    model = tiny_gpt(n_layer=1)        # no dropout: train and eval mode compute the same
    model.train(train_mode)
    engine, *_ = shardwise.initialize(model=model, config=CONFIG)
    losses = _steps(engine, 2)
    out = {"losses": losses, "global_steps": engine.global_steps, "activations": engine.memory_report()["activations"],
           "comm": sorted((r["op"], r["group"], r["bytes"]) for r in engine.comm_report())}
    with torch.no_grad():        # an evaluation forward is no step: nothing counted or measured
        engine(*lm_pair(token_batches(1, 2, 17, seed=6)[0]))
    out["after no_grad forward"] = (engine.micro_steps, engine.memory_report()["activations"])
    engine.close()
    return out


def test_a_model_left_in_eval_mode_trains_with_the_steps_record() -> None:
    trained, left_in_eval = _run(True), _run(False)
    assert left_in_eval["comm"], "the eval-mode model's step has no communication record"
    assert left_in_eval["activations"] > 0
    assert left_in_eval == trained
    assert trained["after no_grad forward"] == (4, trained["activations"])


def test_engine_optimizer_reports_an_fp16_overflow_skip_as_deepspeeds() -> None:
    import shardwise
    config = {**CONFIG, "gradient_accumulation_steps": 1,
              "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    engine, optimizer, _, scheduler = shardwise.initialize(model=tiny_gpt(n_layer=1), config=config)
    assert optimizer is engine.optimizer
    # still the torch optimizer that steps, the same object, of its own class (the config's "AdamW": DeepSpeed's
    # FusedAdam, a torch Adam with decoupled weight decay)
    inner = engine.updater.optimizer
    assert optimizer is inner and optimizer.optimizer is inner and isinstance(optimizer, FusedAdam)
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["decoupled_weight_decay"]
    assert (optimizer.overflow, optimizer.cur_scale, optimizer.loss_scale) == (False, 256.0, 256.0)

    _steps(engine, 1)
    assert (optimizer.overflow, engine.was_step_applied(), optimizer.cur_scale) == (False, True, 256.0)
    assert optimizer.state_dict()["state"] == inner.state_dict()["state"] != {}

    # an inf gradient: the step is skipped and the scale halved; the next clean step clears `overflow`
    before = [p.detach().clone() for p in engine.module.parameters()]
    inputs, labels = lm_pair(token_batches(1, 2, 17, seed=7)[0])
    loss = engine(inputs, labels)
    engine.backward(loss * float("inf"))
    engine.step()
    assert (optimizer.overflow, engine.was_step_applied(), optimizer.cur_scale) == (True, False, 128.0)
    assert all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    _steps(engine, 1)
    assert (optimizer.overflow, engine.was_step_applied(), engine.skipped_steps) == (False, True, 1)

    optimizer.cur_scale = 64.0            # settable, as DeepSpeed's
    assert (engine.optimizer.loss_scale, engine.steps.loss_scale) == (64.0, 64.0)
    # an LR scheduler built on it drives the groups the engine steps
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert inner.param_groups[0]["lr"] == 0.5e-3 and sched.get_last_lr() == [0.5e-3]
    optimizer.zero_grad()
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_load_module_state_dict_is_what_the_next_steps_start_from(stage: int) -> None:
    """fp16 keeps fp32 masters apart from the module's weights: a load that left them would be undone by the
    next update. lr 0 makes the update the identity, so the weights after it are the masters."""
    import shardwise
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
              "fp16": {"enabled": True, "initial_scale_power": 4}, "zero_optimization": {"stage": stage}}
    engine, *_ = shardwise.initialize(model=tiny_gpt(n_layer=1), config=config)
    whole = engine.consolidated_state_dict()
    shifted = {k: v + 0.5 if v.is_floating_point() else v for k, v in whole.items()}
    with pytest.raises(shardwise.UserError, match='"module"'):
        engine.load_module_state_dict(shifted)
    left_out = sorted(whole)[-1]
    partial = {k: v for k, v in shifted.items() if k != left_out}
    with pytest.raises(shardwise.UserError, match=left_out):
        engine.load_module_state_dict({"module": partial}, allowed_missing_keys=[])
    assert engine.load_module_state_dict({"module": partial}, allowed_missing_keys=[left_out]) is None
    _steps(engine, 1)
    after = engine.consolidated_state_dict()
    assert engine.was_step_applied()
    for k, v in partial.items():
        assert torch.equal(after[k], v), k
    engine.close()


def test_the_returned_optimizer_is_the_clients_own_object() -> None:
    """DeepSpeed returns the client's optimizer itself at stage 0 in fp32, and a callable's product as built;
    the members DeepSpeed's wrappers carry are there too."""
    import shardwise
    config = {"train_micro_batch_size_per_gpu": 2}
    model = tiny_gpt(n_layer=1)
    client = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=config, optimizer=client)
    assert optimizer is client and engine.optimizer is client and isinstance(client, torch.optim.Adam)
    assert (client.overflow, client.cur_scale) == (False, 1.0)
    _steps(engine, 1)
    assert client.state_dict()["state"] != {}
    engine.close()
    model = tiny_gpt(n_layer=1)
    engine, optimizer, _, _ = shardwise.initialize(model=model, config=config,
                                                   optimizer=lambda params: torch.optim.AdamW(params))
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer is engine.optimizer
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_an_engine_without_an_optimizer_runs_forward_and_refuses_an_update(stage: int) -> None:
    """DeepSpeed's initialize takes no optimizer (Hugging Face's ZeRO-3 evaluation does that) and returns None for
    it; forward and backward run, and an update is refused in one line instead of silently doing nothing."""
    import shardwise
    from shardwise.errors import UserError
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine, optimizer, _, scheduler = shardwise.initialize(model=tiny_gpt(n_layer=1), config=config)
    assert optimizer is None and scheduler is None
    inputs, labels = lm_pair(token_batches(1, 2, 17, seed=7)[0])
    loss = engine(inputs, labels)
    assert torch.isfinite(loss)
    engine.backward(loss)
    with pytest.raises(UserError, match="without an optimizer") as refused:
        engine.step()
    assert "\n" not in str(refused.value)
    engine.close()


def test_initialize_without_a_model_is_one_line() -> None:
    import shardwise
    from shardwise.errors import UserError
    with pytest.raises(UserError, match="model= must be a torch.nn.Module") as refused:
        shardwise.initialize(model=None, config={"train_micro_batch_size_per_gpu": 1})
    assert isinstance(refused.value, ValueError) and "\n" not in str(refused.value)


def test_no_sync_misuse_is_an_assertion_error_as_deepspeeds() -> None:
    """DeepSpeed asserts there; scripts written for it catch AssertionError. Ours is also the one-line UserError."""
    import shardwise
    from shardwise.errors import UserError
    engine, *_ = shardwise.initialize(model=tiny_gpt(n_layer=1),
                                      config={**CONFIG, "zero_optimization": {"stage": 0}})
    inputs, labels = lm_pair(token_batches(1, 2, 17, seed=7)[0])
    with engine.no_sync():
        with pytest.raises(AssertionError, match="reentry is unsupported") as nested:
            with engine.no_sync():
                pass
        engine.backward(engine(inputs, labels))
        with pytest.raises(AssertionError, match="illegal to call Engine.step") as stepped:
            engine.step()
    assert isinstance(nested.value, UserError) and isinstance(stepped.value, UserError)
    engine.close()
    engine, *_ = shardwise.initialize(model=tiny_gpt(n_layer=1),
                                      config={**CONFIG, "zero_optimization": {"stage": 2}})
    with pytest.raises(AssertionError, match="no_sync context manager is incompatible"):
        with engine.no_sync():
            pass
    engine.close()


def test_an_optimizers_own_members_are_not_shadowed() -> None:
    """A client optimizer that has its own `optimizer` (a wrapper's inner one) keeps it; the others are added."""
    import shardwise

    class Wrapping(torch.optim.SGD):
        def __init__(self, params):
            super().__init__(params, lr=0.1)
            self.optimizer = "its own inner optimizer"

    model = tiny_gpt(n_layer=1)
    client = Wrapping(model.parameters())
    engine, optimizer, _, _ = shardwise.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2},
                                                   optimizer=client)
    assert optimizer is client and optimizer.optimizer == "its own inner optimizer"
    assert (optimizer.overflow, optimizer.cur_scale) == (False, 1.0)
    _steps(engine, 1)
    engine.close()
