"""DeepSpeed's `runtime.pipe.topology` names: the row-major rank layout of `ProcessTopology` and the groups
`PipelineParallelGrid` makes of it (the grid's process groups stubbed: each group is its rank list, so one process
checks what every rank of a 2 x 2 x 2 job would hold)."""

from __future__ import annotations

import pytest

from shardwise.runtime.pipe import topology
from shardwise.runtime.pipe.topology import (PipeDataParallelTopology, PipelineParallelGrid,
                                             PipeModelDataParallelTopology, ProcessTopology, _prime_factors)


def test_ranks_are_row_major_over_the_axes() -> None:
    topo = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert [topo.get_rank(pipe=p, data=d, model=m) for p in range(2) for d in range(2) for m in range(2)] == \
        list(range(8))
    assert topo.get_coord(6) == topo.ProcessCoord(pipe=1, data=1, model=0) and topo.world_size() == 8
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("expert") == [] and topo.get_dim("expert") == 0
    assert topo.filter_match(pipe=0, data=1) == [2, 3] and topo.get_axis_list("data", 0) == [0, 1, 4, 5]
    assert topo.get_rank_repr(5) == "model_01" and topo.get_rank_repr(5, omit_axes=[]) == "pipe_01-data_00-model_01"
    with pytest.raises(ValueError):
        topo.get_rank(pipe=0)
    assert PipeDataParallelTopology(num_pp=2, num_dp=3).get_coord(4) == (1, 1)
    assert PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=3).axes == ["pipe", "data", "model"]
    assert _prime_factors(12) == [2, 2, 3] and _prime_factors(1) == []
    with pytest.raises(ValueError):
        _prime_factors(0)


@pytest.mark.parametrize("rank", range(8))
def test_grid_groups_of_each_rank(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    monkeypatch.setattr(topology.dist, "get_rank", lambda: rank)
    monkeypatch.setattr(topology.dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(topology.dist, "new_group", lambda ranks: tuple(ranks))
    topo = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    grid = PipelineParallelGrid(topology=topo)
    me = topo.get_coord(rank)
    assert (grid.stage_id, grid.data_parallel_id, grid.get_slice_parallel_rank()) == (me.pipe, me.data, me.model)
    assert grid.is_first_stage == (me.pipe == 0) and grid.is_last_stage == (me.pipe == 1)
    # each group: the ranks that differ from this one in that axis only
    assert grid.get_pipe_parallel_group() == tuple(topo.filter_match(data=me.data, model=me.model))
    assert grid.get_data_parallel_group() == tuple(topo.filter_match(pipe=me.pipe, model=me.model))
    assert grid.get_slice_parallel_group() == tuple(topo.filter_match(pipe=me.pipe, data=me.data))
    assert grid.get_model_parallel_group() == tuple(topo.filter_match(data=me.data))      # one model copy
    assert grid.stage_to_global(stage_id=1 - me.pipe) == topo.get_rank(pipe=1 - me.pipe, data=me.data,
                                                                      model=me.model)
    assert grid.p2p_groups[rank] == [rank, topo.get_rank(pipe=1 - me.pipe, data=me.data, model=me.model)]


def test_grid_without_topology_deals_the_prime_factors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topology.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(topology.dist, "get_world_size", lambda: 12)
    monkeypatch.setattr(topology.dist, "new_group", lambda ranks: tuple(ranks))
    grid = PipelineParallelGrid()             # 12 = 2 * 2 * 3: pipe 2 * 3, data 2
    assert (grid.get_pipe_parallel_world_size(), grid.get_data_parallel_world_size()) == (6, 2)
