"""Context parallelism: one sequence split over the cp ranks (ring attention, Ulysses). See `strategy.py`."""

from shardwise.parallel.context.attention import ContextParallelCore, RingAttention, UlyssesAttention, grouped_sdpa
from shardwise.parallel.context.interface import BatchPart, ContextAttention, WholeBatch
from shardwise.parallel.context.layout import SequenceLayout, SequenceSplitError
from shardwise.parallel.context.strategy import (
    ContextParallel, build_context_parallel, check_context_parallel, layout_for,
)

__all__ = ["BatchPart", "ContextAttention", "ContextParallel", "ContextParallelCore", "RingAttention",
           "SequenceLayout", "SequenceSplitError", "UlyssesAttention", "WholeBatch", "build_context_parallel",
           "check_context_parallel", "grouped_sdpa", "layout_for"]
