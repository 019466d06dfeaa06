"""Numbers no setting can take, refused in one line naming the key before anything is built: betas that are not
a pair, a size or count beyond int64 and a rate beyond float32 (a 1e300 lr or bucket size, which a float holds
but no count, size or fp32 rate does)."""

from __future__ import annotations

import pytest

from shardwise.config import ConfigError, load_config_for_world

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

REFUSED = {
    "three betas": ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95, 0.99]}}},
                    "optimizer.params.betas", "take two betas"),
    "one beta": ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9]}}},
                 "optimizer.params.betas", "take two betas"),
    "a scalar beta": ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "betas": 0.9}}},
                      "optimizer.params.betas", "take two betas"),
    "lr 1e300": ({"optimizer": {"type": "AdamW", "params": {"lr": 1e300}}}, "optimizer.params.lr", "out of range"),
    "max lr 1e39": ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e39}}},
                    "scheduler.params.warmup_max_lr", "out of range"),
    "bucket 1e300": ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e300}},
                     "zero_optimization.reduce_bucket_size", "out of range"),
    "prefetch -1e20": ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": -1e20}},
                       "zero_optimization.stage3_prefetch_bucket_size", "out of range"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_number_no_setting_takes_is_one_line_naming_the_key(case: str) -> None:
    extra, key, rule = REFUSED[case]
    with pytest.raises(ConfigError) as error:
        load_config_for_world({**BASE, **extra}, world_size=2)
    line = str(error.value)
    assert "\n" not in line and f'"{key}"' in line and rule in line, line


def test_numbers_in_range_still_load() -> None:
    load_config_for_world({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
                           "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}, world_size=2)
    load_config_for_world({**BASE, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e18}},
                          world_size=2)


def test_train_refuses_a_micro_batch_whose_token_ids_exceed_the_node_in_one_line(capsys, tmp_path) -> None:
    import json
    import os

    from shardwise.cli.main import main

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    micro = memory // (33 * 8) + 1                 # token ids int64 [micro, 33]: one byte-row over the node's memory
    config = tmp_path / "big.json"
    config.write_text(json.dumps({**BASE, "train_micro_batch_size_per_gpu": micro}))
    assert main(["train", str(config), "--seq-len", "32", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"train_micro_batch_size_per_gpu {micro}" in err and "beyond" in err, err
    assert not (tmp_path / "run").exists()
    from shardwise.cli.train import _check_micro_batch_fits
    _check_micro_batch_fits(micro // 4, 32, 1)       # a quarter of the node: not refused by this bound


def test_a_huge_but_representable_rate_loads_and_a_huge_size_does_not() -> None:
    """A rate of 1e38 is absurd but a float32 holds it (the non-finite guards are tested with one); a size of 1e20
    fits no int64."""
    load_config_for_world({**BASE, "optimizer": {"type": "SGD", "params": {"lr": 1e38, "momentum": 0.9}}},
                          world_size=2)
    with pytest.raises(ConfigError, match="size or count"):
        load_config_for_world({**BASE, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e20}}, world_size=2)
