"""Rank arithmetic of the (pp, dp, tp) layout, tp innermost: golden groups and round-trip properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwise.comm.topology import Axis, MeshShape, TopologyError


def test_tp2_dp2_groups():
    shape = MeshShape(dp=2, tp=2)
    assert shape.groups(Axis.TP) == [[0, 1], [2, 3]]          # consecutive ranks: one node
    assert shape.groups(Axis.DP) == [[0, 2], [1, 3]]          # equal tp rank
    assert shape.groups(Axis.PP) == [[0], [1], [2], [3]]
    assert shape.coords(3) == {Axis.PP: 0, Axis.DP: 1, Axis.TP: 1}


def test_pp2_dp2_tp2_groups():
    shape = MeshShape(pp=2, dp=2, tp=2)
    assert shape.groups(Axis.TP) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups(Axis.DP) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups(Axis.PP) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.group_of(Axis.DP, 5) == [5, 7]


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_coords_round_trip_and_groups_partition_the_world(pp: int, dp: int, tp: int):
    shape = MeshShape(pp=pp, dp=dp, tp=tp)
    for rank in range(shape.world_size):
        c = shape.coords(rank)
        assert shape.rank_of(pp=c[Axis.PP], dp=c[Axis.DP], tp=c[Axis.TP]) == rank
    for axis in (Axis.PP, Axis.DP, Axis.TP):
        groups = shape.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(shape.world_size))
        assert all(len(g) == shape.size(axis) for g in groups)
        for g in groups:   # members differ only along `axis`, and are listed in that coordinate's order
            assert [shape.coords(r)[axis] for r in g] == list(range(shape.size(axis)))


def test_world_size_must_be_a_multiple_of_the_model_parallel_size():
    assert MeshShape.for_world(8, tp=2) == MeshShape(dp=4, tp=2)
    with pytest.raises(TopologyError, match=r"tensor_parallel.size = 3 .* does not divide the world size 4 "
                                            r"\(4 = 3 \* 1 \+ 1\).* use a tensor_parallel.size in \[1, 2, 4\]"):
        MeshShape.for_world(4, tp=3)
    with pytest.raises(TopologyError, match="tp = 0 must be a positive integer"):
        MeshShape(tp=0)
