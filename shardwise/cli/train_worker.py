"""What each rank of `shardwise train` runs (started by torchrun: `python -m shardwise.cli.train_worker ARGS`).

Every rank builds the same model from the same seed, the engine and its own slice of the data; global
rank 0 alone draws the progress bar, writes RUN_DIR/metrics.jsonl after every step (loss, lr, throughput,
gradient norm, loss scale, skipped steps), and at the end prints the summary and writes
RUN_DIR/summary.json and RUN_DIR/loss.png. The inputs were validated by the parent (`shardwise.cli.train`), so
a failure here is a bug or an environment problem, not a typo; it becomes a report for the launcher
(`rank_reports`), not a traceback per rank.

The ranks start from RUN_DIR/checkpoints/latest when it exists (a resumed run, a restarted attempt: `resume`),
append to metrics.jsonl, and after every step agree whether a signal asked them to stop (`stop`): then they
save that step and leave.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

import shardwise
from shardwise.cli.rank_reports import EXIT_CRASH, EXIT_USER_ERROR, USER, write_failure, write_stopped
from shardwise.cli.resume import client_state, resume
from shardwise.cli.run_dir import CHECKPOINT_DIR, LOGS_DIR, METRICS_FILE
from shardwise.cli.stop import StopRequest
from shardwise.cli.train import WorkerArgs
from shardwise.cli.train_model import RunData, build_run_model
from shardwise.data import CorpusError, load_corpus
from shardwise.errors import UserError
from shardwise.models.registry import flops_per_token as model_flops_per_token
from shardwise.comm.topology import Axis
from shardwise.telemetry.node_log import NodeLog, RankPlace
from shardwise.telemetry.peak import device_peak_flops
from shardwise.parallel.experts import moe_step_metrics
from shardwise.telemetry.metrics import DROPPED_SUFFIX, drop_rows_after, format_rate
from shardwise.telemetry.peak_cache import (
    PeakCache, PeakFlops, PeakGuard, PeakOrigin, agree_measured, measured_peak, resolve_peak,
)
from shardwise.telemetry import (
    MetricsWriter,
    StepMetrics,
    TrainProgress,
    current_rss_bytes,
    final_history,
    plot_loss_curve,
    print_summary,
    read_metrics,
    summarize_run,
)

SUMMARY_FILE = "summary.json"
PLOT_FILE = "loss.png"

T = TypeVar("T")


@dataclass(frozen=True)
class Stopped:
    """A run stopped by a signal: which, after which step, and the checkpoint it saved."""

    signum: int
    step: int
    checkpoint: str


def rank_peak_flops(args: WorkerArgs, compute_dtype: torch.dtype, device: torch.device,
                    cache: PeakCache) -> PeakFlops:
    """This rank's peak FLOP/s: --peak-tflops if given, else a known GPU's datasheet peak for the training dtype,
    else the cached figure of this machine, else a matmul measured now in the training dtype (and cached).

    Every rank that measures does so at the same time (they have just synchronised in `initialize`), so
    the figure includes the contention of ranks sharing cores and memory bandwidth, as training does.
    """
    def source(d: torch.device, t: torch.dtype) -> tuple[float, str]:
        # A known GPU's datasheet peak (never cached); otherwise the measured one.
        return device_peak_flops(d, t) if d.type == "cuda" else measured_peak(d, t)

    return resolve_peak(device=device, dtype=compute_dtype, given_tflops=args.peak_tflops, cache=cache,
                        source=source)


def gather(value: T) -> list[T]:
    """One Python object from every rank, in rank order (small values only: pickled through the store)."""
    out = [value] * dist.get_world_size()       # every slot is overwritten with that rank's value
    dist.all_gather_object(out, value)
    return out


def _write_pipeline_trace(engine, out: Path, is_main: bool) -> None:
    """The last step's per-action timings of data-parallel replica 0's stages, as a picture and JSON.
    One rank per stage records: the tensor-parallel ranks of a stage run the same actions at the same
    time, and counting each of them would put tp copies of every action on the stage's row.
    Times share one clock on one host (CLOCK_MONOTONIC); across hosts each stage keeps its own offsets."""
    from shardwise.parallel.pipeline.simulate import Timeline
    from shardwise.parallel.pipeline.timeline import draw_timeline
    last = engine.pipeline.last
    records_here = engine.dp_rank == 0 and engine.mesh.rank(Axis.TP) == 0
    mine = [(r.stage, str(r.action), r.start, r.end) for r in last.records] if records_here else []
    records = [r for rank in gather(mine) for r in rank]
    if not is_main:
        return
    t0 = min(r[2] for r in records)
    records = [(stage, action, (start - t0) * 1e3, (end - t0) * 1e3) for stage, action, start, end in records]
    cfg = engine.config.pipeline
    timeline = Timeline.from_records(records, num_stages=cfg.stages)
    draw_timeline(timeline, out / "pipeline_timeline.png", time_unit="ms",
                  title=f"measured {cfg.schedule.value}: P={cfg.stages}, M={engine.gradient_accumulation_steps()}, "
                        f"V={cfg.virtual_stages}, bubble {timeline.bubble_fraction:.1%}")
    (out / "pipeline_trace.json").write_text(json.dumps(
        {"bubble_fraction": timeline.bubble_fraction, "unit": "ms",
         "records": [{"stage": s, "action": a, "start": b, "end": e} for s, a, b, e in records]}, indent=1))
    print(f"pipeline: measured bubble fraction {timeline.bubble_fraction:.3f} (last step); wrote "
          f"{out / 'pipeline_timeline.png'}", flush=True)


def train(args: WorkerArgs, stop: StopRequest | None = None) -> Stopped | None:
    """Train from RUN_DIR/checkpoints/latest if there is one (a resumed run, or a restarted attempt), else from
    step 0. Returns where the run stopped when a signal stopped it, None when it ran all its steps."""
    stop = stop or StopRequest()
    shardwise.init_distributed()
    rank = dist.get_rank()
    is_main = rank == 0
    out = Path(args.out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    # Read the corpus before `initialize`: its first broadcast then lines the ranks up, so the peak
    # measurement runs on all ranks at once and step 1 does not include a slower rank's loading.
    tokens = load_corpus(args.data)
    torch.manual_seed(args.seed)       # same init on every rank (initialize also broadcasts rank 0's)
    choice, model = build_run_model(args)
    flops_per_token = model_flops_per_token(choice, model)      # of the whole model, before any slicing
    with warnings.catch_warnings():
        # The parent printed the config's warnings once before launching; every rank would repeat them.
        warnings.simplefilter("ignore", shardwise.ConfigWarning)
        engine, _, _, _ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=args.config)
    engine.monitor.progress_lines = False      # rank 0's TrainProgress prints the one line of each interval
    batch = engine.config.batch
    data = RunData.build(tokens, args, choice, engine)     # with --eval-every, the held-out split is cut off
    loader = data.loader
    checkpoints = out / CHECKPOINT_DIR
    resumed = resume(engine, loader, checkpoints)
    done, clock = (resumed.step, resumed.elapsed_s) if resumed is not None else (0, 0.0)
    if is_main and resumed is not None:
        again = f"attempt {attempt + 1}: " if attempt else ""
        streams = "" if resumed.rng_restored else "; the data-parallel size changed: dropout draws new masks"
        print(f"shardwise: {again}resumed from {resumed.path} at step {done}{streams}", flush=True)
    if is_main:
        # Rows after the resumed step belong to weights no checkpoint holds (a dead attempt, an earlier tag
        # resumed): set aside, so every step appears once and the curve is the weights' history.
        moved = drop_rows_after(out / METRICS_FILE, done)
        if moved:
            print(f"shardwise: {moved} metrics row(s) after step {done} moved to "
                  f"{METRICS_FILE.removesuffix('.jsonl')}{DROPPED_SUFFIX} (not this run's history)", flush=True)

    compute_dtype = getattr(engine, "compute_dtype", torch.float32)
    # Every rank resolves its peak (those that measure do so at once), then they agree on one figure per kind of
    # device; one writer per node caches that figure, so a later run divides by what this one does.
    rank_peak = rank_peak_flops(args, compute_dtype, engine.device, PeakCache(writer=False))
    peaks = agree_measured(gather(rank_peak))
    rank_peak = peaks[rank]
    peak_cache = PeakCache(writer=int(os.environ.get("LOCAL_RANK", "0")) == 0)
    if rank_peak.origin is PeakOrigin.MEASURED:
        peak_cache.put(rank_peak.cache_key, rank_peak.flops)
    # All ranks together: MFU's denominator. fsum rounds once, so N equal figures make exactly N times the one.
    peak_flops = math.fsum(p.flops for p in peaks)
    guard = PeakGuard(peak_flops, rank_peak, cache=peak_cache if is_main else None)
    tokens_per_step = batch.train_batch_size * args.seq_len     # all ranks together
    if is_main:
        print(f"peak: {rank_peak.describe()}" + (f"; kept in {peak_cache.path}" if rank_peak.cache_key else "")
              + f"; MFU divides by {format_rate(peak_flops)} FLOP/s, the peak of the {len(peaks)} rank(s)",
              flush=True)

    def save(step: int) -> str:
        state = client_state(engine, loader, step=step, elapsed_s=clock + time.perf_counter() - start)
        engine.save_checkpoint(str(checkpoints), client_state=state)
        return str(checkpoints / f"global_step{engine.global_steps}")

    # Appends: a resumed run continues the file (the parent refused or cleared another run's; rows after the
    # resumed step were set aside above).
    writer = MetricsWriter(out / METRICS_FILE) if is_main else None
    stopped: Stopped | None = None
    place = RankPlace.from_env(rank)
    node_log = NodeLog(out, place, gather(place), steps_per_print=args.steps_per_print)
    with TrainProgress(args.steps, enabled=is_main, steps_per_print=args.steps_per_print, done=done) as progress:
        start = time.perf_counter()
        for step in range(done + 1, args.steps + 1):
            lr = engine.get_lr()[0]                # the rate this step's update uses (read before it)
            t0 = time.perf_counter()
            loss = float(engine.train_batch(data.train_batches))   # mean over micro-batches and dp ranks
            step_time = time.perf_counter() - t0
            moe = moe_step_metrics(engine.module, engine.metrics_comm)   # collective; {} without MoE layers
            evaluated = data.evaluate(engine, step, args.steps)   # collective; {} on steps without evaluation
            node_log.step(step, args.steps, loss, step_time)
            if is_main:
                peak_flops = guard.bound(tokens_per_step * flops_per_token / step_time, step)
                assert writer is not None
                m = StepMetrics.build(step=step, loss=loss, lr=lr, tokens=tokens_per_step,
                                      step_time_s=step_time, elapsed_s=clock + time.perf_counter() - start,
                                      flops_per_token=flops_per_token, peak_flops=peak_flops,
                                      rss_bytes=current_rss_bytes(), grad_norm=engine.updater.last_grad_norm,
                                      loss_scale=engine.current_loss_scale, skipped_steps=engine.skipped_steps,
                                      skipped=not engine.was_step_applied(), moe=moe)
                writer.write({**m.row(), **evaluated})
                progress.update(m)
                if evaluated:
                    progress.console.print(f"step {step}: eval loss {evaluated['eval_loss']:.4f}, perplexity "
                                           f"{evaluated['eval_perplexity']:.2f} (held-out split: "
                                           f"{evaluated['eval_windows']} windows, {evaluated['eval_tokens']:,} "
                                           f"tokens)", markup=False, highlight=False, soft_wrap=True)
            saved = args.save_every > 0 and (step % args.save_every == 0 or step == args.steps)
            if saved:
                save(step)
            signum = stop.agreed(engine.sequence_check)     # the same answer on every rank, after the same step
            if signum and step < args.steps:
                path = save(step) if not saved else str(checkpoints / f"global_step{engine.global_steps}")
                stopped = Stopped(signum=signum, step=step, checkpoint=path)
                break
    if writer is not None:
        writer.close()
    if stopped is not None:
        if is_main:
            write_stopped(reports_folder(args), signum=stopped.signum, step=stopped.step,
                          checkpoint=stopped.checkpoint)
        dist.barrier()
        return stopped

    if args.pipeline_trace:
        _write_pipeline_trace(engine, out, is_main)
    memory = gather(engine.memory_report())      # every rank's bytes, for the per-rank table
    node_log.finish(memory)
    if is_main:
        summary = summarize_run(final_history(read_metrics(out / METRICS_FILE)), world_size=dist.get_world_size(),
                                flops_per_token=flops_per_token, peak_flops=peak_flops,
                                memory_per_rank=memory, comm_per_step=engine.comm_report())
        print_summary(summary)
        summary.write_json(out / SUMMARY_FILE)
        plot_loss_curve(out / METRICS_FILE, out / PLOT_FILE,
                        title=f"{args.model} on {args.data}: {dist.get_world_size()} rank(s), seq {args.seq_len}")
        print(f"wrote {out / METRICS_FILE}, {out / SUMMARY_FILE}, {out / PLOT_FILE}", flush=True)
    dist.barrier()      # nobody tears the group down while rank 0 still writes
    return None


def reports_folder(args: WorkerArgs) -> Path:
    """RUN_DIR/logs/LAUNCH: where this launch's ranks leave their failure reports for the launcher."""
    return Path(args.out) / LOGS_DIR / (args.launch or "unnamed")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m shardwise.cli.train_worker RUN_DIR/train_args.json "
              "(started by `shardwise train`)", file=sys.stderr)
        return 2
    stop = StopRequest().install()
    args = WorkerArgs.read(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    try:
        train(args, stop)
    except BaseException as error:  # noqa: BLE001 - every failure becomes a report for the launcher
        # The launcher prints a user error's line, or a crash's last line and where its traceback is; a
        # rank printing its own traceback would repeat it per rank, between the other ranks' output.
        try:
            report = write_failure(reports_folder(args), rank=rank, attempt=attempt, error=error)
        except OSError:
            traceback.print_exc()
            return EXIT_CRASH
        return EXIT_USER_ERROR if report.kind == USER else EXIT_CRASH
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from shardwise.engine.initialize import exit_rank
    exit_rank(main())
