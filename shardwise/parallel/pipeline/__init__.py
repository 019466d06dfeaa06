"""Pipeline parallelism: schedules and partitions as pure data, a simulator, and timeline pictures.

- `schedules`: `Action`, `gpipe`, `one_f_one_b`, `interleaved_one_f_one_b`, `build_schedule`, `forward_only`
  (evaluation), and `transfers` (the sends/receives a runtime derives from a stage's position).
- `partition`: `partition_layers` (uniform / parameters / flops).
- `simulate`: `simulate`, `check_schedule` (deadlock check under async, blocking and batched sends),
  `Timeline` (also built from a measured trace) with makespan, bubble and in-flight figures, and
  `measured_costs` / `replayed_costs` (a measured trace's costs, to simulate it under).
- `formulas`: `formula_bubble_fraction` / `formula_bubble_ratio` (the closed forms, equal stages).
- `comm_plan`: `build_programs` (when each stage posts its sends and receives: a lockstep grid safe under
  NCCL's rules) and `check_programs` (runs programs under those rules).
- `timeline`: `draw_timeline` (matplotlib, imported on use).

Nothing here imports torch.
"""

from shardwise.parallel.pipeline.comm_plan import build_programs, check_programs
from shardwise.parallel.pipeline.formulas import formula_bubble_fraction, formula_bubble_ratio
from shardwise.parallel.pipeline.partition import partition_layers, stage_layers
from shardwise.parallel.pipeline.schedules import (
    Action, ActionTable, Message, Op, PipelineError, Transfer, Transfers, build_schedule, format_actions,
    forward_only, gpipe, interleaved_one_f_one_b, one_f_one_b, parse_schedule_kind, transfers, validate_schedule)
from shardwise.parallel.pipeline.simulate import (
    ActionRecord, Costs, Deadlock, DeadlockError, SendMode, Timeline, check_schedule, measured_costs,
    replayed_costs, simulate)

__all__ = [
    "Action", "ActionRecord", "ActionTable", "Costs", "Deadlock", "DeadlockError", "Message", "Op", "PipelineError",
    "SendMode", "Timeline", "Transfer", "Transfers", "build_programs", "build_schedule", "check_programs",
    "check_schedule", "format_actions", "forward_only", "formula_bubble_fraction", "formula_bubble_ratio", "gpipe",
    "interleaved_one_f_one_b", "measured_costs", "one_f_one_b", "parse_schedule_kind", "partition_layers",
    "replayed_costs", "simulate", "stage_layers", "transfers", "validate_schedule",
]
