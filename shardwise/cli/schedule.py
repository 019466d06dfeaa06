"""`shardwise schedule --stages P --micro-batches M --schedule 1f1b [...]`: simulate a pipeline schedule.

Prints each stage's action list (when short), the simulated bubble next to the closed-form one and
the peak number of micro-batches whose activations each stage holds; draws the timeline with --out.
Pure Python: no torch, no processes.
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction
from typing import Any

from shardwise.errors import UserError

_SHOW_ACTIONS_UP_TO = 48  # per-stage list length printed without --actions


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "schedule", help="simulate a pipeline schedule: bubble, in-flight micro-batches, timeline picture",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", "-p", type=int, required=True, metavar="P", help="pipeline stages")
    parser.add_argument("--micro-batches", "-m", type=int, required=True, metavar="M",
                        help="micro-batches per step (gradient_accumulation_steps)")
    parser.add_argument("--schedule", "-s", default="1f1b", metavar="NAME",
                        help="gpipe, 1f1b or interleaved_1f1b (default: %(default)s)")
    parser.add_argument("--virtual-stages", "-v", type=int, default=None, metavar="V",
                        help="model chunks per stage, interleaved_1f1b only (default: 2 for it, else 1)")
    parser.add_argument("--costs", default="1,2", metavar="F,B",
                        help="forward and backward time of one micro-batch through one whole stage "
                             "(default: %(default)s); with V chunks each chunk takes 1/V of it")
    parser.add_argument("--latency", default="0", metavar="T", help="time added to each point-to-point transfer")
    parser.add_argument("--send-mode", default="async", metavar="MODE",
                        help="async (isend/irecv, the runtime's), blocking (send/recv rendezvous) or batched "
                             "(a send and the next receive posted together); default: %(default)s")
    parser.add_argument("--out", "-o", default=None, metavar="PNG", help="write the timeline picture here")
    parser.add_argument("--actions", action="store_true", help="print the action lists even when long")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=run)
    return parser


def _number(text: str, what: str) -> Fraction:
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise UserError(f"{what} = {text!r} is not a number; write e.g. 1, 2.5 or 3/2") from None
    if value < 0:
        raise UserError(f"{what} = {text!r}: must be >= 0")
    return value


def _costs(text: str) -> tuple[Fraction, Fraction]:
    parts = text.split(",")
    if len(parts) != 2:
        raise UserError(f"--costs = {text!r}: give the forward and backward time as F,B, e.g. --costs 1,2")
    forward, backward = _number(parts[0], "--costs forward"), _number(parts[1], "--costs backward")
    if forward + backward == 0:
        raise UserError(f"--costs = {text!r}: forward and backward cannot both be 0")
    return forward, backward


def _show(x: Fraction | float) -> str:
    return f"{float(x):g}"


def run(args: argparse.Namespace) -> int:
    from shardwise.config import PipelineSchedule
    from shardwise.parallel.pipeline import schedules
    from shardwise.parallel.pipeline.simulate import Costs, SendMode, simulate

    kind = schedules.parse_schedule_kind(args.schedule)
    interleaved = kind is PipelineSchedule.INTERLEAVED_1F1B
    virtual = args.virtual_stages if args.virtual_stages is not None else (2 if interleaved else 1)
    try:
        mode = SendMode(args.send_mode.strip().lower())
    except ValueError:
        raise UserError(f"--send-mode = {args.send_mode!r} is unknown; valid: "
                        f"{', '.join(m.value for m in SendMode)}") from None
    forward, backward = _costs(args.costs)
    costs = Costs(forward=forward, backward=backward, latency=_number(args.latency, "--latency"))
    plan = schedules.build_schedule(kind, num_stages=args.stages, num_microbatches=args.micro_batches,
                                    virtual_stages=virtual)
    timeline = simulate(plan, costs=costs, mode=mode, name=kind.value)
    sizes = dict(num_stages=args.stages, num_microbatches=args.micro_batches, virtual_stages=virtual)
    fraction_formula = schedules.bubble_fraction(kind, **sizes)
    ratio_formula = schedules.bubble_ratio(kind, **sizes)
    peaks = [timeline.peak_in_flight(s) for s in range(args.stages)]

    if args.out:
        from shardwise.parallel.pipeline.timeline import draw_timeline

        title = (f"{kind.value}: P={args.stages}, M={args.micro_batches}, V={virtual}, f={_show(forward)}, "
                 f"b={_show(backward)}  |  bubble {float(timeline.bubble_fraction):.1%} of stage time "
                 f"(formula {float(fraction_formula):.1%})")
        draw_timeline(timeline, args.out, title=title)

    if args.json:
        print(json.dumps({
            "schedule": kind.value, "stages": args.stages, "micro_batches": args.micro_batches,
            "virtual_stages": virtual, "costs": {"forward": float(forward), "backward": float(backward),
                                                 "latency": float(costs.latency)},
            "send_mode": mode.value, "actions": [[str(a) for a in stage] for stage in plan],
            "makespan": float(timeline.makespan),
            "bubble_fraction": float(timeline.bubble_fraction), "bubble_fraction_formula": float(fraction_formula),
            "bubble_ratio": float(timeline.bubble_ratio), "bubble_ratio_formula": float(ratio_formula),
            "peak_in_flight": peaks, "out": args.out,
        }, indent=2))
        return 0

    print(f"{kind.value}: {args.stages} stage(s), {args.micro_batches} micro-batch(es), {virtual} chunk(s) per "
          f"stage; forward {_show(forward)}, backward {_show(backward)} per micro-batch and stage"
          + (f", latency {_show(costs.latency)}" if costs.latency else "") + f"; {mode.value} sends")
    if args.actions or max(len(s) for s in plan) <= _SHOW_ACTIONS_UP_TO:
        width = len(str(args.stages - 1))
        for stage, actions in enumerate(plan):
            print(f"  stage {stage:>{width}}: {schedules.format_actions(actions)}")
    else:
        print(f"  ({max(len(s) for s in plan)} actions per stage; --actions prints them)")
    ideal = args.micro_batches * (forward + backward)
    print(f"makespan           {_show(timeline.makespan)} (no-bubble ideal {_show(ideal)})")
    print(f"bubble fraction    {float(timeline.bubble_fraction):.2%} simulated, {float(fraction_formula):.2%} formula "
          f"(idle / (P x makespan))")
    print(f"bubble ratio       {float(timeline.bubble_ratio):.2%} simulated, {float(ratio_formula):.2%} formula "
          f"(idle / busy, Narayanan's t_pb/t_id)")
    unit = "micro-batches" if virtual == 1 else "(micro-batch, chunk) activations, each 1/V of the stage"
    print(f"peak in flight     {' '.join(map(str, peaks))} per stage, in {unit}")
    if args.out:
        print(f"timeline           {args.out}")
    return 0
