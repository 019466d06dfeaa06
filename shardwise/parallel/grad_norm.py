"""The whole model's gradient norm and overflow verdict, agreed by every rank that holds a part of the model,
so all of them clip alike and skip a step together.

    norms = GradNormReducer.from_mesh(mesh, ledger).for_tensors(shard_layout(buckets), dp_sharded=True)
    overflow, norm, extra = norms.agree(shards, check_overflow=True, want_norm=True).read()   # one host read
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import torch
from torch import Tensor

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.parallel.tensor_parallel.layers import is_tensor_parallel_shard
from shardwise.parallel.precision import nonfinite_flag
from shardwise.comm.topology import Axis, ParallelMesh

Ranges = tuple[tuple[int, int], ...]
"""Flat element ranges [a, b) of one stepped tensor that hold replicated elements."""


def whole_tensor_layout(params: Sequence[Tensor]) -> list[Ranges]:
    """Stage 0: each stepped tensor is one parameter, replicated across TP (all its elements) or a TP slice."""
    return [() if is_tensor_parallel_shard(p) else ((0, p.numel()),) for p in params]


def shard_layout(buckets: Sequence) -> list[Ranges]:
    """ZeRO: each stepped tensor is this rank's shard [S] of a flat bucket (`ZeroBucket` / `FlatShard`: `params`,
    `layout`, `rank`) that may mix TP slices and replicated parameters; the layout says where each lies."""
    return [tuple((dst, dst + hi - lo) for i, lo, hi, dst in b.layout.pieces_in_shard(b.rank)
                  if not is_tensor_parallel_shard(b.params[i]))
            for b in buckets]


@dataclass
class ExtraSums:
    """Device metrics summed over `comm` alongside the step's verdict (fused into its all-reduce when `comm` is the
    model group) and read with its one host read; `values` holds the sums after the step."""

    tensor: Tensor
    """float [k], on the compute device."""
    comm: Comm
    values: list[float] | None = field(default=None, init=False)


@dataclass(frozen=True)
class StepVerdict:
    """What the model group agreed on, still on the device (see [Note: one host read per step] at
    `GradNormReducer.agree`)."""

    overflow: Tensor | None
    """0-dim float64: how many ranks saw inf/nan (None: not checked)."""
    norm: Tensor | None
    """0-dim: the whole model's gradient norm (None: not wanted)."""
    extra: Tensor | None
    """[k] float64: the extra sums."""

    def read(self) -> tuple[bool, float | None, list[float]]:
        """(overflow, norm, extra sums) as Python values: the parts on a device go to the host in ONE copy (parts
        on the host, e.g. the norm of offloaded gradients, in one more that waits for nothing)."""
        parts = [(name, t.reshape(-1).to(torch.float64)) for name, t in
                 (("overflow", self.overflow), ("norm", self.norm), ("extra", self.extra)) if t is not None]
        fetched: dict[bool, Iterator[float]] = {}
        for on_host in (False, True):
            mine = [t for _, t in parts if (t.device.type == "cpu") == on_host]
            if mine:
                fetched[on_host] = iter(torch.cat([t.to(mine[0].device) for t in mine]).tolist())
        values = {name: [next(fetched[t.device.type == "cpu"]) for _ in range(t.numel())] for name, t in parts}
        overflow = "overflow" in values and values["overflow"][0] > 0
        norm = values["norm"][0] if "norm" in values else None
        return overflow, norm, values.get("extra", [])


@dataclass(frozen=True)
class GradNormReducer:
    """Built once from the mesh (`from_mesh`); each update strategy binds it to its stepped tensors
    (`for_tensors`). `clip_` and `overflow` are collective over the model group and the TP group.

    A rank steps some tensors: whole parameters (ZeRO stage 0) or flat shards of buckets (ZeRO 1-3). Their
    elements are of two kinds:
    - sliced: part of a tensor-parallel slice, different on every TP rank (every element, without TP);
    - replicated: part of a parameter every TP rank holds whole (norm weights, row-parallel biases), whose
      gradient is equal on all TP ranks, so it must be counted once.
    Other parts of this rank's TP slice sit on other ranks: the layers of the other pipeline stages, and under
    ZeRO the other dp ranks' shards. Call those ranks the model group (pp ranks for stage 0, pp x dp ranks for
    ZeRO). Then

        ||g||^2 = sum over TP of (sum over the model group of sliced ||g||^2)  +  its sum of replicated ||g||^2

    Per step: one all-reduce of float64 [sliced, replicated] over the model group (16 bytes) and one of the
    sliced part over TP (8 bytes). The overflow flag is the max over the same two groups, so every rank that holds
    part of one model skips a step together.
    """

    stage_comm: Comm
    """The pipeline's stages ("pp:metrics"): the model group of a stage-0 slice."""
    model_comm: Comm
    """pp x dp ranks of one TP coordinate ("dp:metrics", "pp*dp:metrics" under a pipeline): ZeRO's model group."""
    tp_comm: Comm
    """The TP group ("tp:metrics"), over which sliced squares are summed."""
    layout: tuple[Ranges, ...] | None = None
    dp_sharded: bool = False
    uncounted: frozenset[int] = frozenset()
    """Stepped tensors left out of the norm: tied copies whose weight another stage's copy counts."""
    shares: tuple[float, ...] | None = None
    """Per stepped tensor, the share of its squares this rank counts (1 / the dp ranks holding the same copy), when
    dp ranks hold some tensors in common and others not (stage 0 with experts: every dp rank holds the dense
    parameters, the ranks of one expert-dp group an expert's); the model group then sums over dp. None: 1."""

    @classmethod
    def from_mesh(cls, mesh: ParallelMesh, ledger: CommLedger) -> "GradNormReducer":
        pipelined = mesh.size(Axis.PP) > 1
        # Without a pipeline the dp group is the model group: no extra process group is needed for it.
        model = (mesh.comm_sharing_tp(ledger, name="pp*dp:metrics") if pipelined
                 else mesh.comm(Axis.DP, ledger, name="dp:metrics"))
        return cls(stage_comm=mesh.comm(Axis.PP, ledger, name="pp:metrics"), model_comm=model,
                   tp_comm=mesh.comm(Axis.TP, ledger, name="tp:metrics"))

    def for_tensors(self, layout: Sequence[Ranges], *, dp_sharded: bool,
                    uncounted: frozenset[int] = frozenset(),
                    shares: Sequence[float] | None = None) -> "GradNormReducer":
        """This reducer for one list of stepped tensors: `layout[i]` the replicated ranges of tensor i;
        `dp_sharded`: the dp ranks hold disjoint parts (ZeRO) rather than equal copies (stage 0); `uncounted`:
        indices of tensors another rank counts (tied copies); `shares` (with dp_sharded): the fraction of tensor i's
        squares this rank counts."""
        return replace(self, layout=tuple(layout), dp_sharded=dp_sharded, uncounted=frozenset(uncounted),
                       shares=tuple(shares) if shares is not None else None)

    @property
    def model_group(self) -> Comm:
        return self.model_comm if self.dp_sharded else self.stage_comm

    @property
    def alone(self) -> bool:
        """No other rank holds a part of this rank's gradients."""
        return self.model_group.size == 1 and self.tp_comm.size == 1 and not self.uncounted

    def agree(self, params: Sequence[Tensor], *, check_overflow: bool, want_norm: bool,
              extra: ExtraSums | None = None) -> StepVerdict:
        """The step's verdict on the `p.grad`s of `params`, agreed by the model group and the TP group, without a host
        read. Alone, the norm is torch's `get_total_norm` (bitwise the reference's clip_grad_norm_).

        [Note: one host read per step]
        `agree` computes the step's verdict on the gradients' device without reading it: the squares, a count of
        ranks that saw inf/nan (summed: > 0 iff any did, so it rides in the same SUM all-reduce as the squares),
        and metrics the caller adds (`ExtraSums`: train_batch's loss) in one float64 vector per group. Clipping
        then scales by a device coefficient (`clip_with_norm_`), and `StepVerdict.read` is the step's one
        device-to-host read.
        """
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        flag = nonfinite_flag(grads, device) if check_overflow else None
        extra_vec: Tensor | None = None     # the extra sums, float64
        fused: Tensor | None = None         # the same, when they travel in the model group's all-reduce below
        if extra is not None and extra.tensor.numel():
            extra_vec = extra.tensor.reshape(-1).to(torch.float64)
            if extra.comm.size > 1 and extra.comm.group is self.model_group.group and not self.alone:
                fused = extra_vec
            else:
                extra.comm.all_reduce(extra_vec)
        if self.alone:
            norm = torch.nn.utils.get_total_norm(grads) if want_norm and grads else None
            if want_norm and not grads:
                norm = torch.zeros((), dtype=torch.float64)
            return StepVerdict(flag, norm, extra_vec)
        # model group: float64 [sliced, replicated]? [flag]? [extra]?  then TP: [sliced]? [flag]?
        pieces = ([self._local_squares(params)] if want_norm else []) \
            + ([flag.reshape(1).to(device)] if flag is not None else [])
        if fused is not None:
            pieces.append(fused.to(device))
        vec = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64, device=device)
        if vec.numel():
            self.model_group.all_reduce(vec)
        at = 2 if want_norm else 0
        tp_pieces = ([vec[:1]] if want_norm else []) + ([vec[at:at + 1]] if flag is not None else [])
        tp_vec = torch.cat(tp_pieces) if tp_pieces else vec[:0]
        if tp_vec.numel():
            self.tp_comm.all_reduce(tp_vec)
        norm = torch.sqrt(tp_vec[0].clamp_min(0.0) + vec[1]) if want_norm else None
        overflow = tp_vec[-1] if flag is not None else None
        if fused is not None:
            extra_vec = vec[vec.numel() - fused.numel():]
        return StepVerdict(overflow, norm, extra_vec)

    def clip_with_norm_(self, params: Sequence[Tensor], max_norm: float, norm: Tensor) -> None:
        """Scale every `p.grad` by min(1, max_norm / (norm + 1e-6)) on the device (no host read); alone, torch's
        `clip_grads_with_norm_` (bitwise the reference)."""
        if self.alone:
            torch.nn.utils.clip_grads_with_norm_(list(params), max_norm, norm)
            return
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)      # float64, 0-dim
        grads = [p.grad for p in params if p.grad is not None]
        for dtype, device in dict.fromkeys((g.dtype, g.device) for g in grads):
            # The factor in the gradients' dtype, as a Python float would be rounded: x * float32(coef).
            torch._foreach_mul_([g for g in grads if g.dtype == dtype and g.device == device],
                                coef.to(device=device, dtype=dtype))

    def overflow(self, local: bool) -> bool:
        """True on every rank if any rank of the model group or a TP peer saw inf/nan (each checks only what it steps)."""
        if self.alone:
            return local
        flag = self.model_group.all_reduce_object_max(float(local))
        return self.tp_comm.all_reduce_object_max(flag) > 0

    def clip_(self, params: Sequence[Tensor], max_norm: float) -> float:
        """Scale every `p.grad` by max_norm / (norm + 1e-6) when that is below 1 (torch's clip_grad_norm_ rule),
        with the whole model's norm; returns the norm."""
        if self.alone:      # torch's own arithmetic: bitwise the single-process reference
            return float(torch.nn.utils.clip_grad_norm_(list(params), max_norm))
        norm = self.norm(params)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
        return norm

    def total_norm(self, params: Sequence[Tensor]) -> float:
        """The whole model's norm of the `p.grad`s, without clipping (what clip_ would return)."""
        if self.alone:      # the arithmetic of clip_grad_norm_, which clip_ uses alone
            return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        return self.norm(params)

    def norm(self, params: Sequence[Tensor]) -> float:
        sq = self._local_squares(params)
        self.model_group.all_reduce(sq)
        sliced = sq[:1].clone()
        self.tp_comm.all_reduce(sliced)
        return math.sqrt(max(float(sliced), 0.0) + float(sq[1]))

    def _local_squares(self, params: Sequence[Tensor]) -> Tensor:
        """float64 [2]: this rank's (sliced, replicated) sums of squares. All on the gradients' device, so the
        only host read is the final one."""
        layout = self.layout if self.layout is not None else ((),) * len(params)
        if len(layout) != len(params):
            raise ValueError(f"GradNormReducer: {len(params)} stepped tensors, bound to {len(layout)}")
        shares = self.shares if self.shares is not None else (1.0,) * len(params)
        grads = [(p.grad.detach(), ranges, share) for i, (p, ranges, share) in enumerate(zip(params, layout, shares))
                 if p.grad is not None and i not in self.uncounted]
        sq = torch.zeros(2, dtype=torch.float64, device=grads[0][0].device if grads else None)
        for g, ranges, share in grads:
            # float64 accumulation without a float64 copy of the tensor
            total = torch.linalg.vector_norm(g, dtype=torch.float64).square()
            if share != 1.0:
                total = total * share
            if not ranges:
                sq[0] += total
            elif ranges == ((0, g.numel()),):
                sq[1] += total
            else:
                flat = g.reshape(-1)
                rep = torch.zeros((), dtype=torch.float64, device=g.device)
                for a, b in ranges:
                    rep += torch.linalg.vector_norm(flat[a:b], dtype=torch.float64).square() * share
                sq[0] += total - rep
                sq[1] += rep
        return sq
