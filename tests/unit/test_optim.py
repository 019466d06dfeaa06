"""Optimizer mapping and learning-rate schedules (shardwise/optim.py, shardwise/lr_schedules.py)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from shardwise.config import ConfigError, OptimizerSpec, SchedulerSpec
from shardwise.engine.optim import build_optimizer, build_scheduler, check_specs, resolve_optimizer
from shardwise.ops.adam import FusedAdam

torch.set_num_threads(1)


def params(n: int = 1) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4)) for _ in range(n)]


def run_steps(optimizer: torch.optim.Optimizer, steps: int = 3) -> list[torch.Tensor]:
    """A few steps of a fixed quadratic loss; returns the final parameters."""
    for _ in range(steps):
        optimizer.zero_grad()
        loss = sum((p ** 2).sum() * (i + 1) for g in optimizer.param_groups for i, p in enumerate(g["params"]))
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]


# ----- optimizers -----

def test_adam_means_decoupled_weight_decay_as_in_deepspeed() -> None:
    ours = build_optimizer(OptimizerSpec(type="Adam", params={"lr": 0.1, "weight_decay": 0.1}), params())
    # DeepSpeed's class, as DeepSpeed builds for "Adam" (scripts check isinstance); torch AdamW's update
    assert type(ours) is FusedAdam and ours.adam_w_mode
    reference = torch.optim.AdamW(params(), lr=0.1, weight_decay=0.1)
    torch.testing.assert_close(run_steps(ours), run_steps(reference), rtol=0, atol=0)


def test_adam_w_mode_false_is_l2_decay() -> None:
    ours = build_optimizer(OptimizerSpec(type="adam", params={"lr": 0.1, "weight_decay": 0.1,
                                                             "adam_w_mode": False}), params())
    assert type(ours) is FusedAdam and not ours.adam_w_mode
    torch.testing.assert_close(run_steps(ours), run_steps(torch.optim.Adam(params(), lr=0.1, weight_decay=0.1)),
                               rtol=0, atol=0)
    # With a zero gradient, L2 decay moves p by ~lr (Adam normalises the decay term) while
    # decoupled decay moves it by lr * wd * p: the two modes really differ.
    p = torch.nn.Parameter(torch.ones(1))
    l2 = build_optimizer(OptimizerSpec(type="Adam", params={"lr": 0.1, "weight_decay": 0.1, "adam_w_mode": False}), [p])
    p.grad = torch.zeros(1)
    l2.step()
    assert p.item() == pytest.approx(0.9, abs=1e-3)
    q = torch.nn.Parameter(torch.ones(1))
    decoupled = build_optimizer(OptimizerSpec(type="Adam", params={"lr": 0.1, "weight_decay": 0.1}), [q])
    q.grad = torch.zeros(1)
    decoupled.step()
    assert q.item() == pytest.approx(0.99, abs=1e-6)


def test_adamw_is_always_decoupled_and_defaults_follow_fused_adam() -> None:
    choice = resolve_optimizer(OptimizerSpec(type="AdamW", params={"adam_w_mode": False, "betas": [0.9, 0.95]}))
    assert choice.cls is torch.optim.AdamW
    # FusedAdam's weight_decay default is 0, not torch AdamW's 0.01; betas become a tuple.
    assert choice.kwargs == {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}


def test_torch_adam_uses_torch_defaults() -> None:
    optimizer = build_optimizer(OptimizerSpec(type="AdamW", params={"torch_adam": True, "lr": 0.01}), params())
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["weight_decay"] == 0.01


def test_deepspeed_only_adam_keys_are_dropped_where_deepspeed_drops_them() -> None:
    choice = resolve_optimizer(OptimizerSpec(type="Adam", params={"fp32_optimizer_states": True,
                                                                  "set_grad_none": True, "bias_correction": True}))
    assert set(choice.kwargs) == {"lr", "betas", "eps", "weight_decay"}


@pytest.mark.parametrize("extra,key,text", [
    ({"amsgrad": True}, "optimizer.params.amsgrad", "FusedAdam"),
    ({"bias_correction": False}, "optimizer.params.bias_correction", "only true"),
    ({"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm", '"gradient_clipping"'),
    ({"adam_w_mode": 1}, "optimizer.params.adam_w_mode", "true or false"),
    ({"betas1": 0.9}, "optimizer.params.betas1", 'did you mean "betas"?'),
])
def test_adam_parameter_errors(extra: dict, key: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_optimizer(OptimizerSpec(type="Adam", params=extra), params())
    assert info.value.key == key and text in str(info.value)


def test_sgd_with_momentum_matches_torch() -> None:
    spec = OptimizerSpec(type="SGD", params={"lr": 0.05, "momentum": 0.9, "nesterov": True})
    ours = build_optimizer(spec, params(2))
    assert type(ours) is torch.optim.SGD and ours.defaults["momentum"] == 0.9
    reference = torch.optim.SGD(params(2), lr=0.05, momentum=0.9, nesterov=True)
    torch.testing.assert_close(run_steps(ours, 5), run_steps(reference, 5), rtol=0, atol=0)


def test_any_torch_optimizer_by_name_case_insensitively() -> None:
    optimizer = build_optimizer(OptimizerSpec(type="rmsprop", params={"lr": 0.01, "alpha": 0.9}), params())
    assert type(optimizer) is torch.optim.RMSprop and optimizer.defaults["alpha"] == 0.9


def test_param_groups_pass_through() -> None:
    a, b = params(2)
    optimizer = build_optimizer(OptimizerSpec(type="AdamW", params={"lr": 0.1, "weight_decay": 0.1}),
                                [{"params": [a]}, {"params": [b], "weight_decay": 0.0}])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("spec,key,text", [
    (OptimizerSpec(type="Adamm"), "optimizer.type", 'unknown optimizer type "Adamm": did you mean "Adam"?'),
    (OptimizerSpec(type="Lamb"), "optimizer.type", "FusedLamb"),
    (OptimizerSpec(type="SGD", params={"lr": 0.1, "momentom": 0.9}), "optimizer.params.momentom",
     'did you mean "momentum"?'),
    (OptimizerSpec(type="SGD", params={"lr": -1.0}), "optimizer.params", "Invalid learning rate"),
])
def test_optimizer_errors_name_the_key(spec: OptimizerSpec, key: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_optimizer(spec, params())
    assert info.value.key == key and text in str(info.value)


# ----- schedulers: parity with DeepSpeed's own classes -----

PARITY_CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 30}, "adam", 1),
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_num_steps": 40, "warmup_type": "linear"}, "sgd", 2),
    ("WarmupLR", {"warmup_min_lr": [0.0, 1e-5], "warmup_max_lr": [0.01, 0.02], "warmup_num_steps": 1}, "adam", 2),
    ("WarmupDecayLR", {"total_num_steps": 80, "warmup_max_lr": 0.01, "warmup_num_steps": 20}, "adam", 1),
    ("WarmupDecayLR", {"total_num_steps": 60, "warmup_num_steps": 10, "warmup_type": "linear"}, "sgd", 1),
    ("WarmupCosineLR", {"total_num_steps": 90, "warmup_num_steps": 15}, "adam", 2),
    ("WarmupCosineLR", {"total_num_steps": 50, "warmup_num_steps": 10, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.05, "warmup_type": "linear"}, "sgd", 1),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 20}, "adam", 1),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 15,
                  "cycle_second_step_size": 25, "cycle_first_stair_count": 3, "cycle_second_stair_count": 5,
                  "decay_step_size": 4, "decay_lr_rate": 0.1, "decay_mom_rate": 0.02,
                  "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}, "adam", 2),
    ("OneCycle", {"cycle_min_lr": [1e-4, 2e-4], "cycle_max_lr": 1e-2, "cycle_first_step_size": 30,
                  "decay_step_size": 10, "decay_lr_rate": 0.5}, "sgd", 2),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 7}, "adam", 1),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 7, "lr_range_test_step_rate": 2.5,
                     "lr_range_test_staircase": True}, "sgd", 1),
]


def _optimizer(kind: str, groups: int) -> torch.optim.Optimizer:
    group_params = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.005 * (i + 1)} for i in range(groups)]
    if kind == "adam":
        return torch.optim.AdamW(group_params, betas=(0.9, 0.95))
    return torch.optim.SGD(group_params, momentum=0.9)


def _state(optimizer: torch.optim.Optimizer) -> list[float]:
    """lr and momentum terms of every group, flat: [lr, beta1, beta2 | momentum, ...]."""
    out: list[float] = []
    for g in optimizer.param_groups:
        out += [g["lr"], *g["betas"]] if "betas" in g else [g["lr"], g["momentum"]]
    return out


@pytest.fixture(scope="module")
def deepspeed_schedules():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed.runtime.lr_schedules")


@pytest.mark.parametrize("name,schedule_params,kind,groups", PARITY_CASES)
def test_schedule_matches_deepspeed(deepspeed_schedules, name: str, schedule_params: dict, kind: str,
                                    groups: int) -> None:
    theirs_opt, ours_opt = _optimizer(kind, groups), _optimizer(kind, groups)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = getattr(deepspeed_schedules, name)(theirs_opt, **schedule_params)
    ours = build_scheduler(SchedulerSpec(type=name, params=schedule_params), ours_opt)
    assert isinstance(ours, torch.optim.lr_scheduler.LRScheduler)
    sequence = []
    for step in range(101):
        expected, actual = _state(theirs_opt), _state(ours_opt)
        assert actual == pytest.approx(expected, rel=1e-12, abs=1e-15), f"{name} differs at step {step}"
        sequence.append(actual[0])
        theirs_opt.step()
        ours_opt.step()
        theirs.step()
        ours.step()
    assert len(set(sequence)) >= 2  # the schedule actually moves over these 100 steps


def test_scheduler_state_round_trip() -> None:
    spec = SchedulerSpec(type="WarmupCosineLR", params={"total_num_steps": 40, "warmup_num_steps": 5})
    first_opt = _optimizer("adam", 1)
    first = build_scheduler(spec, first_opt)
    for _ in range(12):
        first_opt.step()
        first.step()
    second_opt = _optimizer("adam", 1)
    second = build_scheduler(spec, second_opt)
    second.load_state_dict(first.state_dict())
    for _ in range(5):
        for opt, sched in ((first_opt, first), (second_opt, second)):
            opt.step()
            sched.step()
        assert second.get_last_lr() == first.get_last_lr()


def test_torch_schedulers_are_the_fallback() -> None:
    optimizer = _optimizer("sgd", 1)
    scheduler = build_scheduler(SchedulerSpec(type="StepLR", params={"step_size": 2, "gamma": 0.5}), optimizer)
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR


@pytest.mark.parametrize("spec,key,text", [
    (SchedulerSpec(type="WarmupLRR"), "scheduler.type", 'did you mean "WarmupLR"?'),
    (SchedulerSpec(type="WarmupDecayLR"), "scheduler.params.total_num_steps", "is required by WarmupDecayLR"),
    (SchedulerSpec(type="WarmupLR", params={"warmup_num_step": 3}), "scheduler.params.warmup_num_step",
     'did you mean "warmup_num_steps"?'),
    (SchedulerSpec(type="WarmupLR", params={"warmup_type": "cosine"}), "scheduler.params", '"log" or "linear"'),
    (SchedulerSpec(type="WarmupLR", params={"warmup_num_steps": 0}), "scheduler.params", "positive integer"),
    (SchedulerSpec(type="WarmupLR", params={"last_batch_iteration": 5}), "scheduler.params.last_batch_iteration",
     "resumes from the checkpoint"),
    (SchedulerSpec(type="OneCycle", params={"cycle_min_lr": [0.1, 0.2], "cycle_max_lr": 1.0}), "scheduler.params",
     "one per param group"),
])
def test_scheduler_errors_name_the_key(spec: SchedulerSpec, key: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_scheduler(spec, _optimizer("adam", 1))
    assert info.value.key == key and text in str(info.value)


def test_check_specs_builds_both() -> None:
    choice = check_specs(OptimizerSpec(type="Adam", params={"lr": 0.1}), SchedulerSpec(type="WarmupLR"))
    assert choice is not None and "torch.optim.AdamW(lr=0.1" in choice.describe()
    with pytest.raises(ConfigError, match="cycle_max_lr"):
        check_specs(None, SchedulerSpec(type="OneCycle", params={"cycle_min_lr": 0.1}))
