"""The README's table of DeepSpeed features still refused is exact: every config key `refuse_unimplemented` refuses
is in it, and each refusal is one error line naming that key (the API arguments are checked beside their code:
test_pipe_compat.py, test_deepspeed_api_local.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.config import ConfigError, load_config
from shardwise.config.unsupported import FEATURE_NAMES

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
TABLE = README[README.index("Still refused"):]
TABLE = TABLE[:TABLE.index("\n\n", TABLE.index("| --- |"))]

ZERO3 = {"stage": 3}
# refused key -> a config (besides train_batch_size) that switches it on
REFUSED: dict[str, dict] = {
    "zero_optimization.offload_optimizer.device": {"zero_optimization": {**ZERO3, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/tmp"}}},
    "zero_optimization.offload_param.device": {"zero_optimization": {**ZERO3, "offload_param": {
        "device": "nvme", "nvme_path": "/tmp"}}},
    "zero_optimization.offload_optimizer.ratio": {"zero_optimization": {**ZERO3, "offload_optimizer": {
        "device": "cpu", "ratio": 0.5}}},
    "zero_optimization.offload_optimizer.super_offload": {"zero_optimization": {**ZERO3, "offload_optimizer": {
        "device": "cpu", "super_offload": True}}},
    "zero_optimization.zero_quantized_weights": {"zero_optimization": {**ZERO3, "zero_quantized_weights": True}},
    "zero_optimization.zero_quantized_nontrainable_weights": {"zero_optimization": {
        **ZERO3, "zero_quantized_nontrainable_weights": True}},
    "zero_optimization.zero_quantized_gradients": {"zero_optimization": {**ZERO3, "zero_quantized_gradients": True}},
    "zero_optimization.zero_hpz_partition_size": {"zero_optimization": {**ZERO3, "zero_hpz_partition_size": 2}},
    "zero_optimization.zenflow": {"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}},
    "communication_data_type": {"zero_optimization": {"stage": 1}, "communication_data_type": "fp32"},
    "prescale_gradients": {"zero_optimization": {"stage": 1}, "prescale_gradients": True},
    "gradient_predivide_factor": {"zero_optimization": {"stage": 1}, "gradient_predivide_factor": 2.0},
    "communication.all_reduce": {"zero_optimization": {"stage": 1}, "communication": {"all_reduce": "ring"}},
    "data_types.grad_accum_dtype": {"data_types": {"grad_accum_dtype": "fp32"}},
    "gradient_allreduce_op": {"gradient_allreduce_op": "sum"},
    "pipeline.activation_checkpoint_interval": {"pipeline": {"activation_checkpoint_interval": 1}},
    **{name: {name: {"enabled": True}} for name in FEATURE_NAMES
       if name not in ("compile", "datastates_ckpt", "weight_quantization")},
    "weight_quantization": {"weight_quantization": {"quantized_initialization": {"num_bits": 8}}},
    "compile": {"compile": {"deepcompile": True}},
    "datastates_ckpt": {"datastates_ckpt": {}},
}


def _in_table(key: str) -> bool:
    candidates = {key, key.removeprefix("zero_optimization."), key.split(".")[0]}
    return any(f"`{c}`" in TABLE for c in candidates)


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_each_refusal_is_one_line_naming_the_key_and_in_the_readme(key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, **REFUSED[key]}, dp_size=1)
    assert [p.key for p in err.value.problems] == [key]
    assert "\n" not in str(err.value) and key.split(".")[-1] in str(err.value)
    assert _in_table(key), f"README's refused table does not name {key}"


def test_the_readme_names_no_block_that_is_implemented() -> None:
    # monitors and the flops profiler work now (also under a pipeline): the table must not list them
    for name in ("tensorboard", "csv_monitor", "wandb", "comms_logger", "flops_profiler", "wall_clock_breakdown"):
        assert f"`{name}`" not in TABLE
        load_config({"train_batch_size": 8, "pipeline": {"stages": 2},
                     name: True if name == "wall_clock_breakdown" else {"enabled": True}}, dp_size=1)
