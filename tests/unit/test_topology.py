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
    assert shape.coords(3) == {Axis.PP: 0, Axis.DP: 1, Axis.CP: 0, Axis.TP: 1}


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


def test_cp_sits_between_dp_and_tp_and_folds_into_dp():
    shape = MeshShape(dp=2, tp=2, cp=2)
    assert shape.groups(Axis.TP) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups(Axis.CP) == [[0, 2], [1, 3], [4, 6], [5, 7]]       # one sequence: same (dp, tp), tp apart
    assert shape.groups(Axis.DP) == [[0, 4], [1, 5], [2, 6], [3, 7]]       # cp * tp apart
    assert shape.coords(6) == {Axis.PP: 0, Axis.DP: 1, Axis.CP: 1, Axis.TP: 0}
    # Folded, the dp groups are the dp x cp ranks holding the same parameters (one per TP coordinate).
    assert shape.folded() == MeshShape(dp=4, tp=2)
    assert shape.folded().groups(Axis.DP) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(TopologyError, match=r"context_parallel.size = 3\) does not divide the world size 4"):
        MeshShape.for_world(4, cp=3)


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3))
def test_folding_cp_keeps_every_rank_and_its_replicas(pp: int, dp: int, cp: int, tp: int):
    shape = MeshShape(pp=pp, dp=dp, tp=tp, cp=cp)
    folded = shape.folded()
    for rank in range(shape.world_size):
        c, f = shape.coords(rank), folded.coords(rank)
        assert shape.rank_of(**{a.value: c[a] for a in c}) == rank
        assert (f[Axis.PP], f[Axis.DP], f[Axis.TP]) == (c[Axis.PP], c[Axis.DP] * cp + c[Axis.CP], c[Axis.TP])
        replicas = {r for r in range(shape.world_size)
                    if (shape.coords(r)[Axis.PP], shape.coords(r)[Axis.TP]) == (c[Axis.PP], c[Axis.TP])}
        assert set(folded.group_of(Axis.DP, rank)) == replicas
