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
    from shardwise.engine.initialize import _config_source
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


@pytest.mark.parametrize("kwargs, match", [
    ({"remote_device": "nvme"}, r"zero.Init\(remote_device='nvme'\): only None .* NVMe offload is not"),
    ({"zero_param_parallel_group": object()}, r"zero.Init\(zero_param_parallel_group=...\): hierarchical"),
    ({"zero_quantized_weights": True}, r"zero.Init\(zero_quantized_weights=...\): quantized"),
    ({"zero_quantized_nontrainable_weights": True}, r"zero_quantized_nontrainable_weights=...\): quantized"),
    ({"param_swapper": object()}, r"zero.Init\(param_swapper=...\): NVMe parameter swapping"),
    ({"mpu": object()}, r"zero.Init\(mpu=object\): the mpu needs get_data_parallel_world_size"),
    ({"data_parallel_group": 1, "sequence_data_parallel_group": 1}, "not both"),
])
def test_zero_init_refuses_what_is_not_built_in_one_line(kwargs: dict, match: str) -> None:
    from shardwise.errors import UserError
    from shardwise.zero import Init
    with pytest.raises(UserError, match=match) as info:
        Init(**kwargs)
    assert "\n" not in str(info.value)


def test_zero_init_disabled_and_mpu_as_deepspeed_reads_them() -> None:
    from shardwise.config import ConfigError
    from shardwise.parallel.zero.params import PARTITION_ATTR
    from shardwise.zero import Init
    model = torch.nn.Linear(3, 3)
    before = model.weight.detach().clone()
    Init(module=model, enabled=False, remote_device="cpu", pin_memory=True, mem_efficient_linear=False)
    assert not hasattr(model, PARTITION_ATTR) and torch.equal(model.weight, before)   # untouched

    class Mpu:      # DeepSpeed's config reads the batch rule's data-parallel size from the mpu
        def get_data_parallel_world_size(self) -> int:
            return 2

        def get_model_parallel_world_size(self) -> int:
            return 1
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 7}}
    assert Init(config_dict_or_path=config, mpu=Mpu())._zero_section().stage3_param_persistence_threshold == 7
    with pytest.raises(ConfigError, match="train_batch_size"):     # one process: 8 != 4 * 1 * 1
        Init(config_dict_or_path=config)._zero_section()


def test_one_batch_argument_maps_to_the_forward_parameters() -> None:
    """`engine(batch)`: positional unless the forward takes labels where the positions do not reach; then an
    (inputs, labels) pair passes labels=, and a longer tuple is refused (its middle items have no safe place)."""
    import shardwise
    from shardwise.engine.step import BatchUnpacking

    class LabelsSecond(torch.nn.Module):       # our GPT's shape: the pair is positional
        def forward(self, input_ids, labels=None, attention_mask=None): ...

    class HuggingFace(torch.nn.Module):        # labels far down, as transformers' models
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs): ...

    class KeywordLabels(torch.nn.Module):
        def forward(self, x, mask=None, *, labels=None): ...

    class Whole(torch.nn.Module):              # one parameter: the batch as it is
        def forward(self, batch): ...

    def split(module: torch.nn.Module, batch):
        return BatchUnpacking.of(module).split(batch)

    assert split(LabelsSecond(), (1, 2)) == ((1, 2), {}) and split(LabelsSecond(), (1, 2, 3)) == ((1, 2, 3), {})
    for module in (HuggingFace(), KeywordLabels()):
        assert split(module, (1, 2)) == ((1,), {"labels": 2}) and split(module, [1, 2]) == ((1,), {"labels": 2})
        assert split(module, {"input_ids": 1}) == ((), {"input_ids": 1}) and split(module, (1,)) == ((1,), {})
        with pytest.raises(shardwise.UserError, match="3-item tuple.*labels"):
            split(module, (1, 2, 3))
    assert split(HuggingFace(), (1, 2, 3, 4)) == ((1, 2, 3, 4), {})      # the positions reach labels
    assert split(Whole(), (1, 2)) == (((1, 2),), {}) and split(Whole(), {"a": 1}) == (({"a": 1},), {})
