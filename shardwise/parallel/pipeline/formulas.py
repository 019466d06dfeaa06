"""The pipeline bubble in closed form, for equal stage costs and free communication: what `simulate`
reproduces exactly with equal costs, and the yardstick a measured bubble is read against.

With P stages, M micro-batches and V model chunks per stage, the idle time over the busy time is (P-1)/M
for GPipe and 1F1B, and (P-1)/(V*M) for interleaved 1F1B with M >= P (Huang et al. 2019, "GPipe";
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
section 2.2). The case M < P of the interleaved schedule is worked out below."""

from __future__ import annotations

from fractions import Fraction

from shardwise.config import PipelineSchedule
from shardwise.parallel.pipeline.schedules import parse_schedule_kind


def _formula_idle_and_busy(kind: str | PipelineSchedule, num_stages: int, num_microbatches: int,
                           virtual_stages: int) -> tuple[int, int]:
    """(idle, busy) per stage in units of (t_f + t_b) / V, with equal stage costs and no latency.

    Busy: V*M. Idle: P - 1 (the fill and drain of one round), plus, for interleaved with M < P,
    (V - 1) (P - M): a group of M < P micro-batches waits P - M slots at each of the V - 1 returns
    to the first stage. Not interleaved: V = 1.
    """
    v = virtual_stages if parse_schedule_kind(kind) is PipelineSchedule.INTERLEAVED_1F1B else 1
    idle = num_stages - 1 + (v - 1) * max(0, num_stages - num_microbatches)
    return idle, v * num_microbatches


def formula_bubble_fraction(kind: str | PipelineSchedule, *, num_stages: int, num_microbatches: int,
                            virtual_stages: int = 1) -> Fraction:
    """Idle share of the time with equal stage costs: (P-1)/(M+P-1); interleaved (M >= P): (P-1)/(V*M+P-1)."""
    idle, busy = _formula_idle_and_busy(kind, num_stages, num_microbatches, virtual_stages)
    return Fraction(idle, idle + busy)


def formula_bubble_ratio(kind: str | PipelineSchedule, *, num_stages: int, num_microbatches: int,
                         virtual_stages: int = 1) -> Fraction:
    """Idle over busy with equal stage costs (Narayanan's t_pb/t_id): (P-1)/M; interleaved (M >= P):
    (P-1)/(V*M), the same divided by V."""
    idle, busy = _formula_idle_and_busy(kind, num_stages, num_microbatches, virtual_stages)
    return Fraction(idle, busy)
