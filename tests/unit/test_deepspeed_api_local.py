"""DeepSpeed's script API in one process: `shardwise.ops.adam` against torch's Adam and AdamW, and
`add_config_arguments` with the config places `initialize(args=...)` reads (the distributed script is in
tests/distributed/test_deepspeed_api.py)."""

from __future__ import annotations

import argparse

import pytest
import torch


def _one_step(opt_cls, **kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    opt = opt_cls(lin.parameters(), **kwargs)
    for _ in range(3):
        opt.zero_grad()
        lin(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in lin.parameters()])


def test_fused_and_cpu_adam_follow_adamw_mode() -> None:
    from shardwise.ops.adam import DeepSpeedCPUAdam, FusedAdam
    common = dict(lr=1e-2, weight_decay=0.1)
    adamw = _one_step(torch.optim.AdamW, **common)
    adam_l2 = _one_step(torch.optim.Adam, **common)
    assert not torch.allclose(adamw, adam_l2)
    torch.testing.assert_close(_one_step(FusedAdam, **common), adamw)
    torch.testing.assert_close(_one_step(FusedAdam, adam_w_mode=False, **common), adam_l2)
    torch.testing.assert_close(_one_step(DeepSpeedCPUAdam, **common), adamw)
    torch.testing.assert_close(_one_step(DeepSpeedCPUAdam, adamw_mode=False, **common), adam_l2)
    # DeepSpeed's defaults, not AdamW's weight decay of 0.01
    torch.testing.assert_close(_one_step(FusedAdam), _one_step(torch.optim.AdamW, lr=1e-3, weight_decay=0.0))


def test_adam_refusals() -> None:
    from shardwise.errors import UserError
    from shardwise.ops.adam import DeepSpeedCPUAdam, FusedAdam
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(UserError, match="amsgrad"):
        FusedAdam(params, amsgrad=True)
    with pytest.raises(UserError, match="bias_correction"):
        FusedAdam(params, bias_correction=False)
    with pytest.raises(UserError, match="fp32_optimizer_states"):
        DeepSpeedCPUAdam(params, fp32_optimizer_states=False)


def test_add_config_arguments_and_config_from_args(tmp_path) -> None:
    import shardwise
    from shardwise.initialization import _config_source
    parser = shardwise.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed_config", "a.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == \
        (False, "a.json", False, None)
    model = torch.nn.Linear(2, 2)
    assert _config_source(model, None, None, args) == "a.json"
    assert _config_source(model, None, None, parser.parse_args(["--deepscale_config", "b.json"])) == "b.json"
    with pytest.raises(shardwise.UserError, match="only one"):
        _config_source(model, {"train_batch_size": 1}, None, args)
    with pytest.raises(shardwise.UserError, match="--deepspeed_config"):
        _config_source(model, None, None, parser.parse_args([]))
