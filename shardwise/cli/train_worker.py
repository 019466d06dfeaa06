"""What each rank of `shardwise train` runs (started by torchrun: `python -m shardwise.cli.train_worker ARGS`).

Every rank builds the same model from the same seed, the engine and its own slice of the data; global
rank 0 alone draws the progress bar, writes RUN_DIR/metrics.jsonl after every step (loss, lr, throughput,
gradient norm, loss scale, skipped steps), and at the end prints the summary and writes
RUN_DIR/summary.json and RUN_DIR/loss.png. The inputs were validated by the parent (`shardwise.cli.train`), so
a failure here is a bug or an environment problem, not a typo.
"""

from __future__ import annotations

import dataclasses
import json

import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise
from shardwise.cli.train import WorkerArgs
from shardwise.cli.train_model import RunData, build_run_model
from shardwise.data import CorpusError, load_corpus
from shardwise.errors import UserError
from shardwise.models.registry import flops_per_token as model_flops_per_token
from shardwise.telemetry import (
    MetricsWriter,
    StepMetrics,
    TrainProgress,
    current_rss_bytes,
    measure_matmul_peak_flops,
    plot_loss_curve,
    print_summary,
    read_metrics,
    summarize_run,
)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "loss.png"
CHECKPOINT_DIR = "checkpoints"


def rank_peak_flops(args: WorkerArgs, compute_dtype: torch.dtype) -> float:
    """This rank's peak FLOP/s: --peak-tflops if given, else a matmul measured now in the training dtype.

    Every rank measures at the same time (they have just synchronised in `initialize`), so the
    figure includes the contention of ranks sharing cores and memory bandwidth, as training does.
    """
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    return measure_matmul_peak_flops(dtype=compute_dtype)


def gather(value: object) -> list[object]:
    """One Python object from every rank, in rank order (small values only: pickled through the store)."""
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _write_pipeline_trace(engine, out: Path, is_main: bool) -> None:
    """The last step's per-action timings of data-parallel replica 0's stages, as a picture and JSON.
    Times share one clock on one host (CLOCK_MONOTONIC); across hosts each stage keeps its own offsets."""
    from shardwise.parallel.pipeline.simulate import Timeline
    from shardwise.parallel.pipeline.timeline import draw_timeline
    last = engine.pipeline.last
    mine = [(r.stage, str(r.action), r.start, r.end) for r in last.records] if engine.dp_rank == 0 else []
    records = [r for rank in gather(mine) for r in rank]
    if not is_main:
        return
    t0 = min(r[2] for r in records)
    records = [(stage, action, (start - t0) * 1e3, (end - t0) * 1e3) for stage, action, start, end in records]
    timeline = Timeline.from_records(records)
    cfg = engine.config.pipeline
    draw_timeline(timeline, out / "pipeline_timeline.png", time_unit="ms",
                  title=f"measured {cfg.schedule.value}: P={cfg.stages}, M={engine.gradient_accumulation_steps()}, "
                        f"V={cfg.virtual_stages}, bubble {timeline.bubble_fraction:.1%}")
    (out / "pipeline_trace.json").write_text(json.dumps(
        {"bubble_fraction": timeline.bubble_fraction, "unit": "ms",
         "records": [{"stage": s, "action": a, "start": b, "end": e} for s, a, b, e in records]}, indent=1))
    print(f"pipeline: measured bubble fraction {timeline.bubble_fraction:.3f} (last step); wrote "
          f"{out / 'pipeline_timeline.png'}", flush=True)


def train(args: WorkerArgs) -> None:
    shardwise.init_distributed()
    rank = dist.get_rank()
    is_main = rank == 0
    out = Path(args.out)

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
    batch = engine.config.batch
    data = RunData.build(tokens, args, choice, engine)     # with --eval-every, the held-out split is cut off

    compute_dtype = getattr(engine, "compute_dtype", torch.float32)
    peak_flops = sum(float(p) for p in gather(rank_peak_flops(args, compute_dtype)))   # all ranks together
    tokens_per_step = batch.train_batch_size * args.seq_len     # all ranks together

    writer = MetricsWriter(out / METRICS_FILE, fresh=True) if is_main else None
    with TrainProgress(args.steps, enabled=is_main, steps_per_print=args.steps_per_print) as progress:
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            lr = engine.get_lr()[0]                # the rate this step's update uses (read before it)
            t0 = time.perf_counter()
            loss = float(engine.train_batch(data.train_batches))   # mean over micro-batches and dp ranks
            step_time = time.perf_counter() - t0
            evaluated = data.evaluate(engine, step, args.steps)   # collective; {} on steps without evaluation
            if is_main:
                assert writer is not None
                m = StepMetrics.build(step=step, loss=loss, lr=lr, tokens=tokens_per_step,
                                      step_time_s=step_time, elapsed_s=time.perf_counter() - start,
                                      flops_per_token=flops_per_token, peak_flops=peak_flops,
                                      rss_bytes=current_rss_bytes(), grad_norm=engine.updater.last_grad_norm,
                                      loss_scale=engine.loss_scale, skipped_steps=engine.skipped_steps)
                writer.write({**dataclasses.asdict(m), **evaluated})
                progress.update(m)
                if evaluated:
                    progress.console.print(f"step {step}: eval loss {evaluated['eval_loss']:.4f}, perplexity "
                                           f"{evaluated['eval_perplexity']:.2f}", markup=False, highlight=False)
            if args.save_every and (step % args.save_every == 0 or step == args.steps):
                engine.save_checkpoint(str(out / CHECKPOINT_DIR))
    if writer is not None:
        writer.close()

    if args.pipeline_trace:
        _write_pipeline_trace(engine, out, is_main)
    memory = gather(engine.memory_report())      # every rank's bytes, for the per-rank table
    if is_main:
        summary = summarize_run(read_metrics(out / METRICS_FILE), world_size=dist.get_world_size(),
                                flops_per_token=flops_per_token, peak_flops=peak_flops,
                                memory_per_rank=memory, comm_per_step=engine.comm_report())
        print_summary(summary)
        summary.write_json(out / SUMMARY_FILE)
        plot_loss_curve(out / METRICS_FILE, out / PLOT_FILE,
                        title=f"{args.model} on {args.data}: {dist.get_world_size()} rank(s), seq {args.seq_len}")
        print(f"wrote {out / METRICS_FILE}, {out / SUMMARY_FILE}, {out / PLOT_FILE}", flush=True)
    dist.barrier()      # nobody tears the group down while rank 0 still writes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m shardwise.cli.train_worker RUN_DIR/train_args.json "
              "(started by `shardwise train`)", file=sys.stderr)
        return 2
    args = WorkerArgs.read(argv[0])
    try:
        train(args)
    except (UserError, CorpusError) as e:
        # The parent validated the inputs; what is left (e.g. a corpus file that changed since) is still
        # the user's to fix, so say it in one line, once.
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"shardwise: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from shardwise.initialization import exit_rank
    exit_rank(main())
