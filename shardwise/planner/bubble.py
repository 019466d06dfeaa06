"""Pipeline bubble: the idle time of p stages filling and draining m micro-batches.

Narayanan et al. 2021 section 2.2, t = forward + backward time of one micro-batch on one stage:

    GPipe and 1F1B:  bubble t_pb = (p - 1) t, ideal t_id = m t: ratio (p - 1) / m, share of the iteration
                     (p - 1) / (m + p - 1)
    interleaved 1F1B with v model chunks per rank: the bubble shrinks to (p - 1) t / v
1F1B has GPipe's bubble but holds at most p micro-batches in flight instead of m.
"""

from __future__ import annotations

from shardwise.config import PipelineSchedule
from shardwise.planner.specs import PlannerError


def _check(stages: int, microbatches: int, virtual_stages: int) -> None:
    for name, value in (("stages", stages), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlannerError(f"pipeline {name} = {value!r}: must be a positive integer")


def _bubble_units(stages: int, schedule: PipelineSchedule, virtual_stages: int) -> float:
    """The bubble in units of one micro-batch's time t."""
    v = virtual_stages if schedule is PipelineSchedule.INTERLEAVED_1F1B else 1
    return (stages - 1) / v


def bubble_ratio(*, stages: int, microbatches: int, schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
                 virtual_stages: int = 1) -> float:
    """Bubble time over ideal time: (p - 1) / m, divided by v when interleaved (Narayanan's t_pb / t_id)."""
    _check(stages, microbatches, virtual_stages)
    return _bubble_units(stages, schedule, virtual_stages) / microbatches


def bubble_fraction(*, stages: int, microbatches: int, schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B,
                    virtual_stages: int = 1) -> float:
    """Share of the iteration spent idle: (p - 1) / (m + p - 1) for GPipe and 1F1B (GPipe paper's
    O((K - 1) / (M + K - 1))); interleaved ((p - 1) / v) / (m + (p - 1) / v)."""
    _check(stages, microbatches, virtual_stages)
    bubble = _bubble_units(stages, schedule, virtual_stages)
    return bubble / (microbatches + bubble)


def pipeline_seconds(*, microbatch_seconds: float, stages: int, microbatches: int,
                     schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B, virtual_stages: int = 1) -> float:
    """Iteration time ignoring data-parallel communication: (m + (p - 1) / v) * t (Narayanan eq. 1)."""
    _check(stages, microbatches, virtual_stages)
    return (microbatches + _bubble_units(stages, schedule, virtual_stages)) * microbatch_seconds


def peak_in_flight(*, stage: int, stages: int, microbatches: int,
                   schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B) -> int:
    """Micro-batches whose activations stage `stage` holds at once: m under GPipe; min(p - stage, m)
    under 1F1B (its warm-up forwards plus one, Megatron's get_pp_rank_microbatches)."""
    _check(stages, microbatches, 1)
    if not 0 <= stage < stages:
        raise PlannerError(f"pipeline stage = {stage}: must be in 0 .. {stages - 1}")
    if schedule is PipelineSchedule.GPIPE:
        return microbatches
    return min(stages - stage, microbatches)
