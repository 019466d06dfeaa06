"""The batch rule (train_batch_size = micro_batch x gradient_accumulation_steps x dp), branch by branch against
DeepSpeed's own (shardwise/config/batch.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from shardwise.config import BatchSizes, ConfigError, load_config, resolve_batch

from config_cases import deepspeed  # tests/unit is on sys.path (pytest's rootdir-relative import)


# ----- batch rule: every branch of DeepSpeed's _set_batch_related_parameters / _batch_assertion -----

def test_all_three_given_and_consistent() -> None:
    assert resolve_batch(train_batch_size=32, micro_batch=4, grad_accum=2, dp_size=4) == BatchSizes(32, 4, 2, 4)


def test_all_three_inconsistent_shows_the_arithmetic() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch(train_batch_size=30, micro_batch=4, grad_accum=2, dp_size=4)
    assert info.value.key == "train_batch_size"
    assert ("train_batch_size 30 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 * "
            "data-parallel size 4 = 32") in str(info.value)


def test_train_and_micro_derive_accumulation() -> None:
    sizes = resolve_batch(train_batch_size=64, micro_batch=4, grad_accum=None, dp_size=4)
    assert sizes == BatchSizes(64, 4, 4, 4)
    assert sizes.derived == ("gradient_accumulation_steps",)


def test_train_and_micro_not_a_multiple() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch(train_batch_size=30, micro_batch=4, grad_accum=None, dp_size=4)
    text = str(info.value)
    assert ("train_batch_size 30 is not a multiple of train_micro_batch_size_per_gpu 4 * data-parallel size 4 = 16"
            in text)
    assert "30 / 16" in text and "16 or 32" in text


def test_train_smaller_than_one_micro_batch_per_rank() -> None:
    # DeepSpeed derives accumulation 8 // 4 // 4 = 0 and then fails its > 0 assertion.
    with pytest.raises(ConfigError, match="train_batch_size 8 is not a multiple of .* = 16"):
        resolve_batch(train_batch_size=8, micro_batch=4, grad_accum=None, dp_size=4)


def test_train_and_accumulation_derive_micro() -> None:
    sizes = resolve_batch(train_batch_size=64, micro_batch=None, grad_accum=2, dp_size=4)
    assert sizes == BatchSizes(64, 8, 2, 4)
    assert sizes.derived == ("train_micro_batch_size_per_gpu",)


def test_train_and_accumulation_not_a_multiple() -> None:
    with pytest.raises(ConfigError, match=r"train_batch_size 30 is not a multiple of gradient_accumulation_steps "
                                          r"2 \* data-parallel size 4 = 8"):
        resolve_batch(train_batch_size=30, micro_batch=None, grad_accum=2, dp_size=4)


def test_micro_and_accumulation_derive_train() -> None:
    sizes = resolve_batch(train_batch_size=None, micro_batch=3, grad_accum=5, dp_size=2)
    assert sizes == BatchSizes(30, 3, 5, 2)
    assert sizes.derived == ("train_batch_size",)


def test_only_train_means_one_accumulation_step() -> None:
    assert resolve_batch(train_batch_size=32, micro_batch=None, grad_accum=None, dp_size=4) == BatchSizes(32, 8, 1, 4)


def test_only_train_not_a_multiple_of_dp() -> None:
    with pytest.raises(ConfigError, match="train_batch_size 30 is not a multiple of data-parallel size 4"):
        resolve_batch(train_batch_size=30, micro_batch=None, grad_accum=None, dp_size=4)


def test_only_micro_means_one_accumulation_step() -> None:
    assert resolve_batch(train_batch_size=None, micro_batch=4, grad_accum=None, dp_size=3) == BatchSizes(12, 4, 1, 3)


@pytest.mark.parametrize("accum", [None, 4])
def test_neither_train_nor_micro_is_an_error(accum: int | None) -> None:
    with pytest.raises(ConfigError, match="give train_batch_size or train_micro_batch_size_per_gpu"):
        resolve_batch(train_batch_size=None, micro_batch=None, grad_accum=accum, dp_size=2)


@pytest.mark.parametrize("field,kwargs", [
    ("train_batch_size", dict(train_batch_size=0, micro_batch=None, grad_accum=None)),
    ("train_micro_batch_size_per_gpu", dict(train_batch_size=None, micro_batch=-2, grad_accum=None)),
    ("gradient_accumulation_steps", dict(train_batch_size=8, micro_batch=None, grad_accum=0)),
])
def test_non_positive_terms_are_rejected(field: str, kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="must be a positive integer") as info:
        resolve_batch(dp_size=2, **kwargs)
    assert info.value.key == field


def test_non_positive_dp_size_is_rejected() -> None:
    with pytest.raises(ConfigError, match="data-parallel size must be a positive integer"):
        resolve_batch(train_batch_size=8, micro_batch=None, grad_accum=None, dp_size=0)


def test_arithmetic_text() -> None:
    assert BatchSizes(32, 4, 2, 4).arithmetic() == (
        "train_batch_size 32 = train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 * data-parallel size 4")


@settings(max_examples=300, deadline=None)
@given(t=st.one_of(st.none(), st.integers(1, 64)), m=st.one_of(st.none(), st.integers(1, 16)),
       g=st.one_of(st.none(), st.integers(1, 8)), d=st.integers(1, 8))
def test_batch_rule_matches_deepspeed(t: int | None, m: int | None, g: int | None, d: int) -> None:
    """DeepSpeed's own two methods, run on a stand-in object, are the oracle for every input."""
    ds_config = deepspeed("deepspeed.runtime.config")
    holder = type("Holder", (), {})()
    holder.train_batch_size, holder.train_micro_batch_size_per_gpu = t, m
    holder.gradient_accumulation_steps, holder.world_size = g, d
    try:
        ds_config.DeepSpeedConfig._set_batch_related_parameters(holder)
        ds_config.DeepSpeedConfig._batch_assertion(holder)
        expected = BatchSizes(holder.train_batch_size, holder.train_micro_batch_size_per_gpu,
                              holder.gradient_accumulation_steps, d)
    except AssertionError:
        expected = None
    if expected is None:
        with pytest.raises(ConfigError):
            resolve_batch(train_batch_size=t, micro_batch=m, grad_accum=g, dp_size=d)
    else:
        assert resolve_batch(train_batch_size=t, micro_batch=m, grad_accum=g, dp_size=d) == expected


def test_load_config_resolves_the_batch_for_dp_size() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, dp_size=4)
    assert cfg.batch == BatchSizes(24, 2, 3, 4)
