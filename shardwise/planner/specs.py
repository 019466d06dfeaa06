"""What the planner reasons about besides the model (a `GPTConfig`): a cluster, a training job, a parallel plan.

Frozen dataclasses of plain ints, floats and enums (no torch), validated on construction. A problem with
what the user gave raises `PlannerError` naming the field, the value, the rule and the fix.
Units: bytes, seconds, FLOPs, FLOP/s and bytes/s throughout; "GB" in reports means 1e9 bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

from shardwise.config import PipelineSchedule
from shardwise.config.schema import ContextParallelImpl
from shardwise.errors import UserError
from shardwise.models.presets import GPTConfig


# -- the enums: precision, optimizer, offload, recomputation, ZeRO-3 gathering ---------------------------------

class Precision(str, enum.Enum):
    """Dtype of weights, gradients and activations; bf16/fp16 also keep fp32 master weights."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def nbytes(self) -> int:
        """Bytes of one weight / gradient / activation element."""
        return 4 if self is Precision.FP32 else 2

    @property
    def mixed(self) -> bool:
        """Mixed precision: the optimizer steps fp32 master copies of the 16-bit weights."""
        return self is not Precision.FP32


class Optimizer(str, enum.Enum):
    """Optimizer family, which fixes the state bytes per parameter (`optimizer_state_bytes`)."""

    ADAM = "adam"                  # Adam and AdamW: momentum + variance in fp32
    SGD_MOMENTUM = "sgd-momentum"  # one fp32 momentum buffer
    SGD = "sgd"                    # no state

    def state_bytes(self, precision: Precision) -> int:
        """The ZeRO paper's K: fp32 optimizer bytes per parameter, the fp32 master copy included
        under mixed precision (Adam + bf16/fp16: 4 master + 4 momentum + 4 variance = 12)."""
        moments = {Optimizer.ADAM: 8, Optimizer.SGD_MOMENTUM: 4, Optimizer.SGD: 0}[self]
        return moments + (4 if precision.mixed else 0)


class Offload(str, enum.Enum):
    """ZeRO-Offload: what lives in CPU memory instead of GPU memory."""

    NONE = "none"
    OPTIMIZER = "optimizer"                   # optimizer states (+ fp32 grads), stepped on the CPU; stages 1-3
    OPTIMIZER_AND_PARAMS = "optimizer+params"  # also the 16-bit parameters; stage 3 only


class Recompute(str, enum.Enum):
    """Activation recomputation (Korthikanti et al. 2022)."""

    NONE = "none"
    SELECTIVE = "selective"   # recompute only the attention core (QK^T, softmax, dropout, AV)
    FULL = "full"             # keep each layer's input, recompute the layer in backward


class Zero3Gather(str, enum.Enum):
    """What ZeRO-3 gathers at once, which sets its buffers and how many collectives it launches."""

    BLOCK = "block"     # one transformer block per all-gather (our engine's units)
    MODULE = "module"   # each Linear / norm module separately (DeepSpeed's hooks)


class PlannerError(UserError, ValueError):
    """A model, cluster, job or plan the planner cannot work with; the message says how to fix it."""


def _positive_int(owner: str, name: str, value: Any, fix: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlannerError(f"{owner}.{name} = {value!r}: must be a positive integer{fix}")


def _positive_number(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PlannerError(f"{owner}.{name} = {value!r}: must be a positive number")


def _enum(owner: str, name: str, value: Any, kind: type[enum.Enum]) -> enum.Enum:
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        valid = ", ".join(repr(k.value) for k in kind)
        raise PlannerError(f"{owner}.{name} = {value!r}: must be one of {valid}") from None


def _coerce_enums(obj: Any, owner: str, fields: dict[str, type[enum.Enum]]) -> None:
    for name, kind in fields.items():
        object.__setattr__(obj, name, _enum(owner, name, getattr(obj, name), kind))


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Identical accelerators in nodes. Bandwidths are per GPU and per direction, in bytes/s."""

    name: str = "custom"
    num_gpus: int
    gpus_per_node: int
    memory_bytes: float
    """Memory of one GPU."""
    peak_flops_bf16: float
    """Dense 16-bit matmul peak of one GPU (also used for fp16)."""
    peak_flops_fp32: float
    """fp32 matmul peak of one GPU (no TF32)."""
    intra_node_bw: float
    """GPU-to-GPU bandwidth inside a node (NVLink), one direction."""
    inter_node_bw: float
    """Network bandwidth of one GPU to other nodes (its share of the node's NICs), one direction."""
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6
    memory_bw: float = 2e12
    """Device memory bandwidth (HBM); bounds the optimizer step, which streams every state once."""
    pcie_bw: float = 25e9
    """Host <-> GPU bandwidth of one GPU (offload traffic)."""
    host_memory_bytes: float = 1e12
    """CPU memory of one node (offloaded states of all its GPUs)."""
    host_memory_bw: float = 100e9
    """CPU memory bandwidth of one node (the offloaded optimizer step of all its GPUs)."""
    compute_efficiency: float = 0.55
    """Fraction of the peak that a large training GEMM sustains: the ceiling of the shape model (kernels.py),
    which adds each GEMM's operand traffic at memory_bw and the memory-bound kernels around the matmuls.
    Communication and bubbles are modelled separately."""
    gemm_operand_bw: float = 0.0
    """Bytes/s at which a GEMM streams its operands and result, the memory side of its time (kernels.py);
    the HBM bandwidth on datasheet presets, fitted by `--calibrate`; 0: FLOPs alone."""
    gather_efficiency: float = 1.0
    """Share of the link bandwidth ZeRO-3's parameter all-gathers and gradient reduce-scatters achieve
    (many collectives of uneven size launched from module hooks; 1: as the other collectives)."""
    reserved_memory_bytes: float = 1e9
    """Taken from every GPU before anything is placed: CUDA context, allocator fragmentation."""
    # Measured by `shardwise plan --calibrate` (CPU ranks, where dense matmuls are not all a step costs). 0 on
    # the datasheet presets: there compute_efficiency stands for everything besides the dense matmuls.
    attention_flops: float = 0.0
    """Sustained FLOP/s of the attention core, forward + backward, counted as flops.py does (4 b s^2 h per
    layer forward, the causal mask ignored); 0: the matmul rate."""
    activation_s: float = 0.0
    """Seconds per element of the MLP nonlinearity (d_ff per token per layer), forward + backward."""
    norm_s: float = 0.0
    """Seconds per element of a normalisation, forward + backward: two per layer and the final one over
    d_model, and the loss's softmax over the vocabulary."""
    layer_overhead_s: float = 0.0
    """Fixed cost of one transformer block's forward + backward whatever its size: its operators' dispatch,
    autograd bookkeeping and kernel launches."""
    microbatch_overhead_s: float = 0.0
    """The same for the rest of a micro-batch (embedding, head, loss)."""
    optimizer_tensor_s: float = 0.0
    """Fixed cost per tensor the optimizer steps (a for-loop Adam runs about ten small operators on each)."""
    cache_bytes: float = 0.0
    """A tensor the optimizer steps whose parameter, gradient and states fit in this much cache streams at
    cache_bw, not memory_bw (a for-loop optimizer passes over each tensor several times); 0: none."""
    cache_bw: float = 0.0
    reduce_scatter_bw: float = 0.0
    """Measured per-collective alpha-beta figures (0: the link's, as all-reduce and sends use)."""
    reduce_scatter_latency_s: float = 0.0
    all_gather_bw: float = 0.0
    all_gather_latency_s: float = 0.0
    comm_overlap: float = 1.0
    """Share of a collective that can hide behind concurrent compute: 1 where links have their own engines
    (GPUs); about 0 where the collectives need the cores the compute runs on (gloo on busy CPU ranks)."""
    source: str = ""
    """Where the figures come from (a datasheet, or how they were measured)."""

    def __post_init__(self) -> None:
        owner = f"cluster {self.name!r}"
        _positive_int(owner, "num_gpus", self.num_gpus)
        _positive_int(owner, "gpus_per_node", self.gpus_per_node)
        for name in ("memory_bytes", "peak_flops_bf16", "peak_flops_fp32", "intra_node_bw", "inter_node_bw",
                     "memory_bw", "pcie_bw", "host_memory_bytes", "host_memory_bw", "compute_efficiency",
                     "gather_efficiency"):
            _positive_number(owner, name, getattr(self, name))
        for name in ("intra_node_latency_s", "inter_node_latency_s", "reserved_memory_bytes", "attention_flops",
                     "activation_s", "norm_s", "layer_overhead_s", "microbatch_overhead_s", "optimizer_tensor_s",
                     "cache_bytes", "cache_bw", "gemm_operand_bw", "reduce_scatter_bw", "reduce_scatter_latency_s",
                     "all_gather_bw", "all_gather_latency_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise PlannerError(f"{owner}.{name} = {value!r}: must be a number >= 0")
        overlap = self.comm_overlap
        if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0 <= overlap <= 1:
            raise PlannerError(f"{owner}.comm_overlap = {self.comm_overlap!r}: a share, must be in [0, 1]")
        for name in ("compute_efficiency", "gather_efficiency"):
            if getattr(self, name) > 1:
                raise PlannerError(f"{owner}.{name} = {getattr(self, name)}: a fraction, must be in (0, 1]")
        if self.reserved_memory_bytes >= self.memory_bytes:
            raise PlannerError(f"{owner}.reserved_memory_bytes = {self.reserved_memory_bytes:.3g} leaves nothing "
                               f"of memory_bytes = {self.memory_bytes:.3g}; lower it")

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.num_gpus / self.gpus_per_node)

    def peak_flops(self, precision: Precision) -> float:
        return self.peak_flops_fp32 if precision is Precision.FP32 else self.peak_flops_bf16

    def replace(self, **changes: Any) -> "ClusterSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, origin: str = "cluster file") -> "ClusterSpec":
        """Build from a dict such as `to_dict()` wrote (a calibration file); unknown keys are an error."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise PlannerError(f"{origin}: unknown key(s) {', '.join(unknown)}; valid keys are "
                               f"{', '.join(sorted(fields))}")
        try:
            return cls(**data)
        except TypeError as e:   # a required key is missing
            raise PlannerError(f"{origin}: {e}".replace("__init__() ", "")) from None


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """The training run: how many tokens, in what batches, at what precision."""

    global_batch: int
    """Sequences per optimizer step (DeepSpeed's train_batch_size)."""
    tokens: float | None = None
    """Training tokens in total; None: 20 tokens per parameter (Hoffmann et al. 2022's compute-optimal)."""
    seq_len: int | None = None
    """Tokens per sequence; None: the model's context length."""
    precision: Precision = Precision.BF16
    optimizer: Optimizer = Optimizer.ADAM
    causal_flops: bool = False
    """Halve the attention-score FLOPs for the causal mask (current Megatron code, our GPT's
    flops_per_token). False is the papers' convention (Narayanan 2021, Korthikanti 2022)."""
    flash_attention: bool = False
    """Attention scores are never materialised (no s^2 activation memory)."""
    overlap_dp_comm: bool = True
    """Gradient reduction overlaps the backward pass (bucketed, as our engine and DeepSpeed do)."""
    pp_scatter_gather: bool = False
    """Pipeline sends carry 1/tp of each boundary activation and the next stage all-gathers it over NVLink
    (Megatron's scatter/gather); without it the whole activation crosses unless sequence parallelism split it."""
    zero3_gather: Zero3Gather = Zero3Gather.BLOCK
    """ZeRO-3 gathers a block at a time (our engine) or each module separately (DeepSpeed)."""
    zero3_prefetch_elements: int = 50_000_000
    """ZeRO-3 gathers up to this many parameters ahead of the compute (stage3_prefetch_bucket_size)."""

    def __post_init__(self) -> None:
        _coerce_enums(self, "job", {"precision": Precision, "optimizer": Optimizer, "zero3_gather": Zero3Gather})
        _positive_int("job", "global_batch", self.global_batch)
        if isinstance(self.zero3_prefetch_elements, bool) or not isinstance(self.zero3_prefetch_elements, int) \
                or self.zero3_prefetch_elements < 0:
            raise PlannerError(f"job.zero3_prefetch_elements = {self.zero3_prefetch_elements!r}: must be an "
                               f"integer >= 0 (0: no prefetch)")
        if self.seq_len is not None:
            _positive_int("job", "seq_len", self.seq_len)
        if self.tokens is not None:
            _positive_number("job", "tokens", self.tokens)

    def sequence_length(self, model: GPTConfig) -> int:
        return self.seq_len if self.seq_len is not None else model.seq_len

    def total_tokens(self, num_params: int) -> float:
        return self.tokens if self.tokens is not None else 20.0 * num_params

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One parallel layout: world = dp * cp * tp * pp ranks,
    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank (the engine's mesh order)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    """Context parallelism: ranks sharing each sequence, each holding S / cp of its tokens. Parameters are
    replicated over cp, so gradients are reduced and ZeRO shards over dp * cp (`replicas`)."""
    cp_impl: ContextParallelImpl = ContextParallelImpl.RING
    """How attention crosses the cp ranks: "ring" (keys and values passed round) or "ulysses" (all-to-all)."""
    zero_stage: int = 0
    offload: Offload = Offload.NONE
    micro_batch: int = 1
    recompute: Recompute = Recompute.NONE
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    """The config's own enum, so a plan exports to "pipeline.schedule" unchanged."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule only)."""
    sequence_parallel: bool = False
    ep: int = 1
    """Expert parallelism: the dp ranks form groups of ep consecutive ones that split each MoE block's experts
    (E / ep each) and exchange tokens by all-to-all; the ranks at the same place of every group hold the same
    experts (the expert-data-parallel group, `expert_replicas`). Must divide dp."""

    def __post_init__(self) -> None:
        _coerce_enums(self, "plan", {"offload": Offload, "recompute": Recompute, "schedule": PipelineSchedule,
                                     "cp_impl": ContextParallelImpl})
        for name in ("dp", "tp", "pp", "cp", "micro_batch", "virtual_stages", "ep"):
            _positive_int("plan", name, getattr(self, name))
        if self.dp % self.ep:
            raise PlannerError(f"plan.ep = {self.ep} does not divide dp = {self.dp}: expert parallelism splits the "
                               f"data-parallel ranks into groups of ep; choose ep dividing dp")
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise PlannerError(f"plan.zero_stage = {self.zero_stage!r}: must be 0, 1, 2 or 3")
        if self.offload is Offload.OPTIMIZER and self.zero_stage == 0:
            raise PlannerError("plan.offload = 'optimizer' needs zero_stage 1, 2 or 3 (ZeRO-Offload shards first)")
        if self.offload is Offload.OPTIMIZER_AND_PARAMS and self.zero_stage != 3:
            raise PlannerError("plan.offload = 'optimizer+params' needs zero_stage 3 (only stage 3 shards params)")
        if (self.schedule is PipelineSchedule.INTERLEAVED_1F1B) != (self.virtual_stages > 1):
            raise PlannerError(f"plan: schedule {self.schedule.value!r} with virtual_stages = {self.virtual_stages}; "
                               f"'interleaved_1f1b' needs virtual_stages >= 2, other schedules need 1")
        if self.sequence_parallel and self.tp == 1:
            raise PlannerError("plan.sequence_parallel needs tp > 1 (it splits activations over the TP group)")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters (the same tp and pp rank): dp * cp. Gradients are reduced over
        them and ZeRO shards over them (cp ranks compute partial gradients of the same parameters)."""
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts: replicas / ep. Expert gradients are reduced and ZeRO-sharded over
        them, every other parameter over all `replicas`."""
        return self.replicas // self.ep

    def grad_accum(self, job: JobSpec) -> int:
        """Micro-batches per step per data-parallel rank (= pipeline micro-batches m)."""
        return job.global_batch // (self.dp * self.micro_batch)

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""), f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}:{self.cp_impl.value}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts += [f"zero{self.zero_stage}", f"mb{self.micro_batch}"]
        if self.offload is not Offload.NONE:
            parts.append(f"offload:{self.offload.value}")
        if self.recompute is not Recompute.NONE:
            parts.append(f"rc:{self.recompute.value}")
        if self.pp > 1:
            parts.append(self.schedule.value + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        return " ".join(parts)

    def replace(self, **changes: Any) -> "Plan":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


def _plain(obj: Any) -> dict[str, Any]:
    """A dataclass as JSON-ready values (enums by value)."""
    return {f.name: (v.value if isinstance(v := getattr(obj, f.name), enum.Enum) else v)
            for f in dataclasses.fields(obj)}
