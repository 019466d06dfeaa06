"""DeepSpeed's `deepspeed.runtime.pipe.topology` import path (Megatron-style scripts build their parallel layout
with it): `ProcessTopology`, its pipe/data(/model) specializations and `PipelineParallelGrid`, the process groups
of such a layout.

    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)     # ranks laid out row-major: pipe outermost
    topo.get_coord(rank=3)                                  # ProcessCoord(pipe=1, data=1)
    grid = PipelineParallelGrid(topology=topo)              # collective: every rank builds every group
    dist.all_reduce(t, group=grid.get_data_parallel_group())

Ranks are numbered row-major over the axes (the first axis varies slowest), as DeepSpeed numbers them, so a
layout and its checkpoint names (`get_rank_repr`) agree with DeepSpeed's. The engine's own layout is
`shardwise.comm.topology.ParallelMesh` (`engine.grid` answers DeepSpeed's grid members from it).
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from typing import Any, Sequence

import torch.distributed as dist

from shardwise.errors import UserError


class ProcessTopology:
    """Named axes of given lengths over the ranks `0 .. prod(dims) - 1`; a rank's coordinate is a namedtuple
    `ProcessCoord` with one field per axis."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]):
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise UserError(f"ProcessTopology(axes={list(axes)}, dims={list(dims)}): give one length per axis, "
                            f"each axis once")
        self.axes = list(axes)
        self.dims = list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        coords = itertools.product(*(range(d) for d in self.dims))
        self.mapping: dict[Any, int] = {self.ProcessCoord(**dict(zip(self.axes, c))): rank
                                        for rank, c in enumerate(coords)}
        self._coords = {rank: coord for coord, rank in self.mapping.items()}

    def get_rank(self, **coord: int) -> int:
        """The rank at a full coordinate (every axis named); `filter_match` selects by some axes."""
        if set(coord) != set(self.axes):
            raise ValueError(f"get_rank() needs every axis ({', '.join(self.axes)}); use filter_match() to select "
                             f"by some of them")
        key = self.ProcessCoord(**coord)
        if key not in self.mapping:
            raise ValueError(f"get_rank(): {coord} is outside the topology {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """`axis_NN` for each axis not omitted, joined: DeepSpeed's checkpoint file names (`model_01`)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes
                              if axis not in omit_axes)

    def get_dim(self, axis: str) -> int:
        """The axis's length; 0 for an axis the topology does not have."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        if rank not in self._coords:
            raise ValueError(f"rank {rank} not found in topology.")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups along `axis`: for each coordinate of the other axes (in row-major order), the ranks that
        differ only in `axis`; [] for an axis the topology does not have."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **criteria: int) -> list[int]:
        """The ranks whose coordinate has the given values on the given axes, in rank order."""
        return [rank for coord, rank in self.mapping.items()
                if all(getattr(coord, axis) == value for axis, value in criteria.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on `axis` is `idx`."""
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages outermost, data parallelism innermost (neighbouring ranks reduce gradients together)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, data and model (tensor) parallelism: axes pipe, data, model, the model axis innermost."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _prime_factors(n: int) -> list[int]:
    """The prime factors of a positive integer, smallest first, with repeats (12 -> [2, 2, 3])."""
    if n <= 0:
        raise ValueError("Values must be strictly positive.")
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


class PipelineParallelGrid:
    """The process groups of a topology over the job's world (collective: every rank creates every group, in the
    same order). Without a topology the world's prime factors are dealt alternately to pipe and data, as in
    DeepSpeed. Members: `stage_id`, `data_parallel_id`, `is_first_stage`, `is_last_stage`, the groups and ranks
    along each axis (`get_pipe_parallel_group()`, `get_data_parallel_group()`, `get_model_parallel_group()`,
    `get_slice_parallel_group()`), `stage_to_global(stage_id, **coord)` and `p2p_groups` (each rank with the next
    stage's rank of its pipeline)."""

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None):
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if topology is None:
            factors = _prime_factors(self.world_size)
            topology = PipeDataParallelTopology(num_pp=math.prod(factors[0::2]), num_dp=math.prod(factors[1::2]))
        self._topo = topology
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        if not self._is_grid_valid():
            raise UserError(f"PipelineParallelGrid: the topology has {topology.world_size()} ranks but the job has "
                            f"{self.world_size}: give dims whose product is the world size")
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        # one model copy: every rank with this data-parallel index (all its stages and slices)
        for dp in range(self.data_parallel_size):
            ranks = sorted(topology.get_axis_list("data", dp)) if "data" in topology.axes else \
                list(range(self.world_size))
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                self.ds_model_proc_group, self.ds_model_rank = group, ranks.index(self.global_rank)
                self.ds_model_world_size = len(ranks)
        self.dp_groups = topology.get_axis_comm_lists("data")
        self.dp_group, self.dp_proc_group = self._groups_along(self.dp_groups)
        self.pipe_groups = topology.get_axis_comm_lists("pipe")
        self.pp_group, self.pp_proc_group = self._groups_along(self.pipe_groups)
        self.p2p_groups = self._build_p2p_groups()
        if self.model_parallel_size == 1:       # each rank its own slice group
            self.slice_group, self.slice_proc_group = self._groups_along([[r] for r in range(self.world_size)])
        else:
            self.model_groups = topology.get_axis_comm_lists("model")
            self.slice_group, self.slice_proc_group = self._groups_along(self.model_groups)

    def _groups_along(self, lists: list[list[int]]) -> tuple[list[int], Any]:
        """A process group per list (collective); this rank's list and group."""
        mine: tuple[list[int], Any] = ([], None)
        for ranks in lists:
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                mine = (ranks, group)
        return mine

    def _build_p2p_groups(self) -> list[list[int]]:
        """For every rank, [rank, the rank of the next stage in its pipeline] (the last stage wraps to the first)."""
        pairs = []
        for rank in range(self.world_size):
            pipe = next((ranks for ranks in self.pipe_groups if rank in ranks), [rank])
            pairs.append([rank, pipe[(pipe.index(rank) + 1) % len(pipe)]])
        return pairs

    def _is_grid_valid(self) -> bool:
        return math.prod(self._topo.get_dim(axis) for axis in self._topo.get_axis_names()) == dist.get_world_size()

    def get_stage_id(self) -> int:
        coord = self._topo.get_coord(self.global_rank)
        return getattr(coord, "pipe", 0)

    def get_data_parallel_id(self) -> int:
        coord = self._topo.get_coord(self.global_rank)
        return getattr(coord, "data", 0)

    def stage_to_global(self, stage_id: int, **coord: int) -> int:
        """The rank at `stage_id` (and any other axes given) with this rank's coordinate elsewhere."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **coord)._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.get_stage_id()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.get_stage_id()

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        coord = self._topo.get_coord(self.global_rank)
        return getattr(coord, "model", 0)

    def get_tensor_model_parallel_rank(self) -> int:
        return self.get_slice_parallel_rank()

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group


__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]
