"""The parallel layout of a run: pure rank arithmetic first (`MeshShape`), process groups second
(`ParallelMesh`). Ranks are laid out (pp, dp, cp, tp) with tp innermost, so a TP group is consecutive ranks, and a
context-parallel (cp) group is the ranks sharing one sequence: the same (pp, dp, tp), tp apart.

    mesh = ParallelMesh.build(MeshShape.for_world(world_size, tp=2))   # collective, once per rank
    mesh.comm(Axis.DP, ledger)                                         # passed explicitly to whoever needs it
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch.distributed as dist

from shardwise.comm.collectives import Comm, collectives_at_world_one
from shardwise.comm.ledger import CommLedger
from shardwise.errors import UserError


class Axis(enum.StrEnum):
    PP = "pp"
    DP = "dp"
    CP = "cp"
    TP = "tp"


AXES: tuple[Axis, ...] = (Axis.PP, Axis.DP, Axis.CP, Axis.TP)
"""Outermost first."""


class TopologyError(UserError, ValueError):
    """Parallel sizes that do not fit the number of processes."""


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the parallel axes. rank = ((pp * dp + dp_index) * cp + cp_index) * tp + tp_index.

    So a TP group is tp consecutive ranks (one node, where the bandwidth is), ranks [d*tp, (d+1)*tp) for
    pp = 0; a CP group is the cp ranks of one (pp, dp, tp), tp apart; a DP group is the ranks with equal
    (pp, cp, tp) coordinates, cp * tp apart. Example, dp=2 x tp=2 on 4 ranks: TP groups {0,1} {2,3}; DP groups
    {0,2} {1,3}. `cp` is the last field (positional shapes written before it keep their meaning) but sits between
    dp and tp in the layout, so folding it into dp (`folded`) gives the same rank arithmetic with dp' = dp * cp.
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis.value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"MeshShape: {axis.value} = {value!r} must be a positive integer")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1) -> "MeshShape":
        """The shape whose data-parallel size fills `world_size` ranks: dp = world / (tp * pp * cp)."""
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            fits = [d for d in range(1, world_size + 1) if world_size % (d * pp * cp) == 0]
            raise TopologyError(
                f"tensor_parallel.size = {tp} (x pipeline.stages = {pp} x context_parallel.size = {cp}) does not "
                f"divide the world size {world_size} ({world_size} = {model_parallel} * "
                f"{world_size // model_parallel} + {world_size % model_parallel}): the data-parallel size is world / "
                f"(tensor_parallel.size * pipeline.stages * context_parallel.size); use a tensor_parallel.size in "
                f"{fits} or launch a multiple of {model_parallel} processes")
        return cls(pp=pp, dp=world_size // model_parallel, tp=tp, cp=cp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def size(self, axis: Axis) -> int:
        return int(getattr(self, Axis(axis).value))

    def folded(self) -> "MeshShape":
        """The same ranks with cp folded into dp (dp' = dp * cp, dp' index = dp_index * cp + cp_index): how the
        parameters see the run, since every cp rank holds the same parameters as its dp peers."""
        return MeshShape(pp=self.pp, dp=self.dp * self.cp, tp=self.tp)

    def coords(self, rank: int) -> dict[Axis, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        pp, rest = divmod(rank, self.dp * self.cp * self.tp)
        dp, rest = divmod(rest, self.cp * self.tp)
        cp, tp = divmod(rest, self.tp)
        return {Axis.PP: pp, Axis.DP: dp, Axis.CP: cp, Axis.TP: tp}

    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, axis: Axis) -> list[list[int]]:
        """Every group along `axis`: the ranks that differ only in that coordinate, in coordinate order.
        Groups are listed by the other coordinates (outermost first), the order every rank creates them."""
        axis = Axis(axis)
        others = [a for a in AXES if a is not axis]
        out = []
        for fixed in itertools.product(*(range(self.size(a)) for a in others)):
            at = dict(zip(others, fixed))
            out.append([self.rank_of(**{a.value: at.get(a, k) for a in AXES}) for k in range(self.size(axis))])
        return out

    def group_of(self, axis: Axis, rank: int) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)

    def groups_sharing(self, axis: Axis) -> list[list[int]]:
        """The ranks with equal `axis` coordinate (they differ in every other one), in rank order; e.g. for
        TP, each group holds one model's worth of optimizer state per TP slice: pp x dp x cp ranks."""
        axis = Axis(axis)
        return [[r for r in range(self.world_size) if self.coords(r)[axis] == k] for k in range(self.size(axis))]


class SoloComm(Comm):
    """The `Comm` of an axis of size 1: a group of this rank alone. Every `Comm` collective is a no-op (or a
    local copy) at size 1, so no process group is needed; creating one per rank would cost a collective
    `new_group` per rank of the world."""

    @property
    def size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    @property
    def local(self) -> bool:
        return True      # its group is no group: never communicate (the test switch needs a world of one)


class ParallelMesh:
    """The process groups of one run, one per axis for this rank. An axis spanning every rank uses the
    default group (no duplicate communicator); an axis of size 1 has no group (`comm` gives a `SoloComm`).

    Beside them, one group of every rank for the guards alone (`guard_comm`: the desync check, the stop vote),
    on gloo whatever the training backend: collectives pair by order within a communicator, so a guard
    collective on the training groups could pair with a drifted rank's gradient bucket (on NCCL silently). On
    their own communicator guard collectives pair only with guard collectives; on the host they never wait behind
    the GPU's queue or a stalled NCCL kernel, and cost no device synchronisation."""

    def __init__(self, shape: MeshShape, rank: int, groups: dict[Axis, dist.ProcessGroup | None],
                 guard: dist.ProcessGroup | None = None):
        self.shape = shape
        self.global_rank = rank
        self._groups = groups
        self._same_tp: dist.ProcessGroup | None = None
        self._guard = guard
        self._replicas: dist.ProcessGroup | None = None
        """With cp > 1: the dp x cp ranks of this rank's (pp, tp), which hold the same parameters."""

    @classmethod
    def build(cls, shape: MeshShape, *, timeout_s: float | None = None) -> "ParallelMesh":
        """Create the groups of `shape` (collective: every rank of the default group must call it), each with
        the backend timeout `timeout_s` (None: torch's default). `dist.new_group` is collective: all ranks create
        every group, in the same order; the mesh's groups are then passed explicitly to the components."""
        import datetime
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        world, rank = dist.get_world_size(), dist.get_rank()
        if shape.world_size != world:
            raise TopologyError(f"the parallel layout {shape} needs {shape.world_size} processes, "
                                f"but {world} were launched")

        def along(layout: MeshShape, axis: Axis) -> dist.ProcessGroup | None:
            """This rank's group along `axis` of `layout`, creating every group of that axis."""
            mine = None
            for ranks in layout.groups(axis):
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine = group
            return mine

        groups: dict[Axis, dist.ProcessGroup | None] = {}
        for axis in AXES:
            size = shape.size(axis)
            if size == world:
                groups[axis] = None
            elif size > 1:
                groups[axis] = along(shape, axis)
        guard = dist.new_group(list(range(world)), timeout=timeout, backend="gloo") if world > 1 else None
        mesh = cls(shape, rank, groups, guard)
        if shape.cp > 1 and 1 < shape.dp and shape.dp * shape.cp < world:   # dp x cp: the folded layout's dp
            mesh._replicas = along(shape.folded(), Axis.DP)
        if shape.tp > 1 and shape.pp * shape.dp * shape.cp > 1:   # the ranks of one TP coordinate (3D, ZeRO under PP)
            for ranks in shape.groups_sharing(Axis.TP):
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mesh._same_tp = group
        return mesh

    def cp_folded(self) -> "ParallelMesh":
        """This mesh as the parameters see it: cp folded into dp (`MeshShape.folded`). Every cp rank holds the same
        parameters as its dp peers, so for gradients, ZeRO shards, norms and checkpoints a cp rank is one more
        data-parallel rank: their dp group is the dp x cp ranks. Itself when cp = 1."""
        if self.shape.cp == 1:
            return self
        folded = self.shape.folded()
        groups: dict[Axis, dist.ProcessGroup | None] = {a: g for a, g in self._groups.items()
                                                        if a in (Axis.PP, Axis.TP)}
        if folded.dp > 1:
            if folded.dp == folded.world_size:
                groups[Axis.DP] = None
            elif self.shape.dp == 1:
                groups[Axis.DP] = self._groups[Axis.CP]
            else:
                groups[Axis.DP] = self._replicas
        mesh = ParallelMesh(folded, self.global_rank, groups, self._guard)
        mesh._same_tp = self._same_tp
        return mesh

    def comm_sharing_tp(self, ledger: CommLedger, name: str) -> Comm:
        """A `Comm` over the ranks with this rank's TP coordinate (every pp x dp rank): where one TP slice of the
        whole model's gradients lives, so its norm and overflow flags are reduced there."""
        if self.shape.pp * self.shape.dp * self.shape.cp == 1 and not self._world_of_one_communicates():
            return SoloComm(None, ledger, name=name)
        return Comm(self._same_tp if self.shape.tp > 1 else None, ledger, name=name)

    def guard_comm(self, ledger: CommLedger, name: str) -> Comm:
        """A `Comm` over every rank on the guards' own gloo group (host tensors); a `SoloComm` in a world of one."""
        if self._guard is None:
            return SoloComm(None, ledger, name=name)
        return Comm(self._guard, ledger, name=name)

    def _world_of_one_communicates(self) -> bool:
        """The test switch (`collectives_at_world_one`) at world size 1: every axis is the world group, whose
        collectives then run for real."""
        return self.shape.world_size == 1 and collectives_at_world_one()

    def size(self, axis: Axis) -> int:
        return self.shape.size(axis)

    def rank(self, axis: Axis) -> int:
        """This rank's coordinate along `axis` (its rank inside that axis' group)."""
        return self.shape.coords(self.global_rank)[Axis(axis)]

    def group(self, axis: Axis) -> dist.ProcessGroup | None:
        axis = Axis(axis)
        if axis not in self._groups:
            raise ValueError(f"the {axis.value} axis has size 1: there is no {axis.value} group to communicate over")
        return self._groups[axis]

    def comm(self, axis: Axis, ledger: CommLedger, name: str | None = None) -> Comm:
        """A `Comm` over this rank's `axis` group, recording into `ledger` under `name` (default: the axis)."""
        name = name or Axis(axis).value
        if self.size(axis) == 1 and not self._world_of_one_communicates():
            return SoloComm(None, ledger, name=name)
        return Comm(self.group(axis), ledger, name=name)

    def __repr__(self) -> str:
        coords = self.shape.coords(self.global_rank)
        return (f"ParallelMesh({self.shape}, rank {self.global_rank} at "
                + ", ".join(f"{a.value}={coords[a]}" for a in AXES) + ")")
