"""Pipeline parallelism. The pure parts are exported here (no torch): schedules and their closed-form bubble
(`schedules`), layer partitions (`partition`), the interpreter of stage programs that simulates them (`simulate`)
and the NCCL-safe posting order of their sends and receives (`comm_plan`). `timeline.draw_timeline` pictures a
timeline; `runtime`, `p2p` and `stage` run a schedule on torch.
"""

from shardwise.parallel.pipeline.comm_plan import build_programs, check_programs
from shardwise.parallel.pipeline.partition import partition_layers, stage_layers
from shardwise.parallel.pipeline.schedules import (
    Action, ActionTable, Message, Op, PipelineError, Transfer, Transfers, bubble_fraction, bubble_ratio,
    build_schedule, format_actions, forward_only, gpipe, interleaved_one_f_one_b, one_f_one_b, parse_schedule_kind,
    transfers, validate_schedule)
from shardwise.parallel.pipeline.simulate import (
    ActionRecord, Costs, Deadlock, DeadlockError, SendMode, Timeline, check_schedule, measured_costs,
    replayed_costs, simulate)

__all__ = [
    "Action", "ActionRecord", "ActionTable", "Costs", "Deadlock", "DeadlockError", "Message", "Op", "PipelineError",
    "SendMode", "Timeline", "Transfer", "Transfers", "bubble_fraction", "bubble_ratio", "build_programs",
    "build_schedule", "check_programs", "check_schedule", "format_actions", "forward_only", "gpipe",
    "interleaved_one_f_one_b", "measured_costs", "one_f_one_b", "parse_schedule_kind", "partition_layers",
    "replayed_costs", "simulate", "stage_layers", "transfers", "validate_schedule",
]
