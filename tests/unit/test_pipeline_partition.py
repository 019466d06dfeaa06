"""Layer partitioning over pipeline stages: uniform (DeepSpeed's remainder rule) and exact balancing."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.config import PipelinePartition
from shardwise.parallel.pipeline.partition import parse_partition_method, partition_layers, stage_layers
from shardwise.parallel.pipeline.schedules import PipelineError


def sizes(parts: list[range]) -> list[int]:
    return [len(r) for r in parts]


def test_uniform_gives_the_remainder_to_the_first_stages() -> None:
    # DeepSpeed's partition_uniform: 10 layers over 4 stages -> 3 3 2 2.
    assert sizes(partition_layers([1.0] * 10, 4, "uniform")) == [3, 3, 2, 2]
    assert partition_layers([5.0] * 8, 2) == [range(0, 4), range(4, 8)]
    assert sizes(partition_layers([1.0] * 7, 7)) == [1] * 7


def test_uniform_ignores_the_cost_values() -> None:
    assert partition_layers([100.0, 1.0, 1.0, 1.0], 2, PipelinePartition.UNIFORM) == [range(0, 2), range(2, 4)]


def test_virtual_stages_cut_model_chunks_in_model_order() -> None:
    chunks = partition_layers([1.0] * 8, 2, "uniform", virtual_stages=2)
    assert chunks == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # Stage p holds model chunks p, p + P, ...: stage 0 has layers 0-1 and 4-5.
    assert stage_layers(chunks, stage=0, num_stages=2) == [range(0, 2), range(4, 6)]
    assert stage_layers(chunks, stage=1, num_stages=2) == [range(2, 4), range(6, 8)]


def test_balanced_golden() -> None:
    # Optimal max load 17: 1+2+3+4+5 | 6+7 | 8+9.
    parts = partition_layers([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, "parameters")
    assert parts == [range(0, 5), range(5, 7), range(7, 9)]
    # A heavy embedding and head at the ends get stages nearly to themselves.
    costs = [50.0] + [10.0] * 6 + [50.0]
    assert sizes(partition_layers(costs, 4, "flops")) == [1, 3, 3, 1]


def test_balanced_with_zero_costs_falls_back_to_uniform() -> None:
    assert sizes(partition_layers([0.0] * 6, 3, "parameters")) == [2, 2, 2]


def test_balanced_with_virtual_stages_needs_no_divisibility() -> None:
    parts = partition_layers([1.0, 1.0, 1.0, 1.0, 4.0], 2, "parameters", virtual_stages=2)
    assert len(parts) == 4 and max(sum([1.0, 1.0, 1.0, 1.0, 4.0][i] for i in r) for r in parts) == 4.0


def _brute_force_max_load(costs: list[float], parts: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=9), st.integers(1, 4), st.sampled_from(["parameters", "flops"]))
def test_balanced_is_optimal_contiguous_and_complete(costs: list[int], stages: int, method: str) -> None:
    if stages > len(costs):
        with pytest.raises(PipelineError, match="more than the model's"):
            partition_layers(costs, stages, method)
        return
    parts = partition_layers(costs, stages, method)
    assert len(parts) == stages and all(len(r) > 0 for r in parts)
    assert [i for r in parts for i in r] == list(range(len(costs)))  # contiguous, in order, all layers
    if sum(costs):
        assert max(sum(costs[i] for i in r) for r in parts) == _brute_force_max_load(costs, stages)


@pytest.mark.parametrize("args, kwargs, match", [
    (([1.0] * 3, 4), {}, "pipeline stages = 4 is more than the model's 3 layer"),
    (([1.0] * 6, 2), {"virtual_stages": 2}, "does not divide the layers: 6 layer"),
    (([1.0] * 6, 2), {"virtual_stages": 4}, "8 model chunks, but the model has 6 layer"),
    (([1.0] * 6, 0), {}, "pipeline stages = 0"),
    (([1.0] * 6, 2), {"virtual_stages": 0}, "virtual_stages = 0"),
    (([1.0, -2.0], 2, "parameters"), {}, "layer 1 cost = -2.0"),
    (([1.0, float("nan")], 2, "flops"), {}, "layer 1 cost = nan"),
    (([1.0] * 4, 2, "param"), {}, "did you mean 'parameters'"),
    (([1.0] * 4, 2, "flop"), {}, "did you mean 'flops'"),
])
def test_clear_errors(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(PipelineError, match=match):
        partition_layers(*args, **kwargs)


def test_method_names_match_the_config_enum() -> None:
    assert {parse_partition_method(m.value) for m in PipelinePartition} == set(PipelinePartition)
    assert parse_partition_method(" Uniform ") is PipelinePartition.UNIFORM
