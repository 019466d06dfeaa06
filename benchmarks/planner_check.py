"""The planner's step time against the engine's on this machine, after calibrating it in the same run.

    python -m benchmarks.planner_check                       # the table; about 40 s on 2 idle cores
    python -m benchmarks.planner_check --rounds 8 --steps 3 --json out.json

For each case (GPT shape x dp x ZeRO stage x micro-batch x accumulation, fp32, AdamW) the prediction is
`planner.step_time` on the cluster `calibrate.cluster_from_probes` makes of this machine; the measurement is
the engine's own loop, `loss = engine(ids, labels); engine.backward(loss); engine.step()` for every
micro-batch of one optimizer step, timed from a barrier to the end of the step (the slowest rank's time).

On a shared machine the load changes from second to second, so both are measured the same way, side by side:
each world size in the cases is a group of spawned gloo ranks that lives for the whole run (dp = 1: one
process, dp = 2: two), and the groups take turns, one round at a time, so at any moment one group works.
In each of its rounds a group runs every calibration probe once (`shardwise.planner.probes.probes`, what
`shardwise plan --calibrate` runs), dealt out between its cases, and each case one untimed step (its caches,
after the other cases ran) and `steps` timed ones. The reported ratio of a case is the median over rounds of
the prediction from that round's probes over that round's median step (paired: a load that changes between
rounds changes both); `predicted` and `measured` are from the medians of all rounds. The one-rank group has
no collectives to fit, and its plans run none: its link figures are the two-rank group's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from benchmarks.common import int_at_least
from shardwise.planner.calibrate import cluster_from_probes, fit_collective, measure_loopback
from shardwise.planner.comm import Op
from shardwise.planner.probes import summarize
from shardwise.planner.specs import ClusterSpec, JobSpec, Optimizer, Plan, Precision
from shardwise.planner.time import StepTime, step_time


@dataclass(frozen=True)
class Case:
    """One engine configuration. `model`: overrides of the "tiny" GPT preset (4 layers, d_model 192, 6 heads,
    seq_len 128, byte vocabulary)."""

    name: str
    dp: int
    zero: int
    micro_batch: int
    grad_accum: int = 1
    model: dict[str, Any] = field(default_factory=dict)
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def gpt_config(self) -> Any:
        from shardwise.models import gpt_config
        return gpt_config("tiny", **self.model)

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.grad_accum


_WIDE = {"n_layer": 2, "d_model": 384, "n_head": 6}                 # 3.8M parameters, big matmuls
_LONG = {"n_layer": 2, "d_model": 128, "n_head": 4, "seq_len": 512}   # attention as costly as the matmuls
_DEEP = {"n_layer": 8, "d_model": 96, "n_head": 4, "seq_len": 64}     # many small operators
CASES = (
    Case("tiny dp1 z0 mb4", dp=1, zero=0, micro_batch=4),
    Case("tiny dp1 z0 mb2 gas2", dp=1, zero=0, micro_batch=2, grad_accum=2),
    Case("wide dp1 z0 mb2", dp=1, zero=0, micro_batch=2, model=_WIDE),
    Case("long dp1 z0 mb1", dp=1, zero=0, micro_batch=1, model=_LONG),
    Case("tiny dp2 z0 mb4", dp=2, zero=0, micro_batch=4),
    Case("tiny dp2 z1 mb4", dp=2, zero=1, micro_batch=4),
    Case("tiny dp2 z2 mb2 gas2", dp=2, zero=2, micro_batch=2, grad_accum=2),
    Case("tiny dp2 z3 mb4", dp=2, zero=3, micro_batch=4),
    Case("wide dp2 z2 mb2", dp=2, zero=2, micro_batch=2, model=_WIDE),
    Case("deep dp2 z1 mb4 gas2", dp=2, zero=1, micro_batch=4, grad_accum=2, model=_DEEP),
)
MODEL_PARALLEL_CASES = (   # `--model-parallel`: tensor and pipeline parallelism on two ranks
    Case("wide tp2 mb2", dp=1, zero=0, micro_batch=2, tp=2, model=_WIDE),
    Case("tiny tp2 mb4", dp=1, zero=0, micro_batch=4, tp=2),
    Case("tiny pp2 mb2 gas4", dp=1, zero=0, micro_batch=2, grad_accum=4, pp=2),
)


def predict(case: Case, cluster: ClusterSpec) -> StepTime:
    """The planner's step time of `case` (no torch)."""
    cfg = case.gpt_config()
    job = JobSpec(global_batch=case.global_batch, seq_len=cfg.seq_len, precision=Precision.FP32,
                  optimizer=Optimizer.ADAM)
    plan = Plan(dp=case.dp, tp=case.tp, pp=case.pp, zero_stage=case.zero, micro_batch=case.micro_batch)
    return step_time(cfg, cluster, job, plan)


# -- the ranks ---------------------------------------------------------------------------------------------

def _build(case: Case, rank: int) -> Callable[[], None]:
    """The engine of `case` and a function that runs one optimizer step on fixed random batches."""
    import torch
    import shardwise
    from shardwise.models import GPT
    torch.manual_seed(0)
    cfg = case.gpt_config()
    model = GPT(cfg)
    config = {"train_batch_size": case.global_batch, "train_micro_batch_size_per_gpu": case.micro_batch,
              "gradient_accumulation_steps": case.grad_accum, "zero_optimization": {"stage": case.zero},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if case.tp > 1:
        config["tensor_parallel"] = {"size": case.tp}
    if case.pp > 1:
        config["pipeline"] = {"stages": case.pp, "schedule": "1f1b"}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(engine.dp_rank)      # the same batches on a TP group and a pipeline
    rows = [torch.randint(0, cfg.vocab_size, (case.micro_batch, cfg.seq_len + 1), generator=g) for _ in range(4)]
    batches = [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]     # ids, labels [mb, s]
    turn = [0]

    def step() -> None:
        if case.pp > 1:      # the pipeline schedule runs all micro-batches of the step
            engine.train_batch(iter([batches[(turn[0] + i) % len(batches)] for i in range(case.grad_accum)]))
            turn[0] += case.grad_accum
            return
        for _ in range(case.grad_accum):
            ids, labels = batches[turn[0] % len(batches)]
            turn[0] += 1
            loss = engine(ids, labels)
            engine.backward(loss)
            engine.step()
    return step


def _round(cases: list[Case], steps: list[Callable[[], None]], timed: int, samples: int) -> tuple[dict, dict]:
    """The calibration probes dealt out between the cases (so a load that changes within the round reaches
    both), each case one untimed step (its caches, after the other cases ran) and `timed` timed ones."""
    import torch.distributed as dist
    from shardwise.planner.probes import probes
    plan = probes(samples)
    share = len(cases) + 1
    measured: dict[str, list[float]] = {}
    times: dict[str, list[float]] = {}
    for i in range(share):
        measured.update((name, call()) for name, call in plan[i::share])
        if i == len(cases):
            break
        steps[i]()
        times[cases[i].name] = []
        for _ in range(timed):
            dist.barrier()
            t0 = time.perf_counter()
            steps[i]()
            times[cases[i].name].append(time.perf_counter() - t0)
    return measured, times


def _rank_main(rank: int, world: int, init_file: str, cases: list[Case], inbox: Any, outbox: Any,
               threads: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        steps = [_build(case, rank) for case in cases]
        outbox.put((rank, "ready", None))
        while (order := inbox.get()) is not None:
            outbox.put((rank, "round", _round(cases, steps, *order)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        outbox.put((rank, "error", traceback.format_exc()))
    finally:
        outbox.close()
        outbox.join_thread()
        os._exit(0)       # skip interpreter teardown (gloo may abort there; see shardwise.engine.initialize.exit_rank)


class _Group:
    """`world` spawned ranks in their own gloo world, each with an inbox of orders; one shared outbox."""

    def __init__(self, ctx: Any, world: int, cases: list[Case], threads: int, tmp: str):
        self.world, self.cases = world, cases
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        init_file = os.path.join(tmp, f"store-{world}")
        self.procs = [ctx.Process(target=_rank_main, daemon=True,
                                  args=(r, world, init_file, cases, self.inboxes[r], self.outbox, threads))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def collect(self, kind: str, timeout: float) -> list[Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            try:
                rank, what, payload = self.outbox.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"planner_check: {self.world}-rank group: rank(s) {dead or 'all'} "
                                       f"{'died' if dead else 'timed out'} waiting for {kind}") from None
                continue
            if what == "error":
                raise RuntimeError(f"planner_check: rank {rank} of the {self.world}-rank group failed:\n{payload}")
            got[rank] = payload
        return [got[r] for r in range(self.world)]

    def order(self, order: Any) -> None:
        for q in self.inboxes:
            q.put(order)

    def close(self) -> None:
        self.order(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# -- the run -----------------------------------------------------------------------------------------------

@dataclass
class Row:
    """`ratios`: per round, the prediction from that round's probes over that round's median step: paired,
    so a load that changes between rounds changes both."""

    case: Case
    predicted: StepTime        # from the medians of all rounds' probes
    measured_s: float          # median of all timed steps
    samples: list[float]
    ratios: list[float]

    @property
    def ratio(self) -> float:
        """Median of the paired per-round ratios, predicted / measured."""
        return statistics.median(self.ratios)


@dataclass
class Report:
    rows: list[Row]
    clusters: dict[int, ClusterSpec]
    seconds: float

    def within(self, tolerance: float) -> list[Row]:
        return [r for r in self.rows if abs(r.ratio - 1.0) <= tolerance]


def _clusters(figures: dict[int, dict[str, float]]) -> dict[int, ClusterSpec]:
    multi = [f for f in figures.values() if f["ranks"] > 1]
    link = fit_collective(Op.ALL_REDUCE, multi[0], int(multi[0]["ranks"])) if multi else measure_loopback()
    return {w: cluster_from_probes(f, link=link) for w, f in figures.items()}


def run(cases: tuple[Case, ...] = CASES, *, rounds: int = 6, steps: int = 2, samples: int = 2, threads: int = 1,
        timeout: float = 300.0) -> Report:
    """Calibrate and measure `cases` interleaved (module notes); predictions from the calibration."""
    start = time.monotonic()
    ctx = mp.get_context("spawn")
    worlds = sorted({c.world for c in cases})
    groups: dict[int, _Group] = {}
    probes: dict[int, list] = {w: [] for w in worlds}          # [round][rank] -> samples
    times: dict[str, list[list[float]]] = {c.name: [] for c in cases}     # [round] -> slowest rank per step
    with tempfile.TemporaryDirectory(prefix="shardwise-planner-check-") as tmp:
        try:
            for w in worlds:
                groups[w] = _Group(ctx, w, [c for c in cases if c.world == w], threads, tmp)
            for g in groups.values():
                g.collect("ready", timeout)
            for _ in range(rounds):
                for w, g in groups.items():
                    g.order((steps, samples))
                    replies = g.collect("a round", timeout)
                    probes[w].append([p for p, _ in replies])
                    for name in replies[0][1]:
                        times[name].append([max(ts) for ts in zip(*(t[name] for _, t in replies))])
        finally:
            for g in groups.values():
                g.close()
    clusters = _clusters({w: summarize([[rnd[r] for rnd in p] for r in range(w)], threads)
                          for w, p in probes.items()})
    per_round = [_clusters({w: summarize([[p[i][r]] for r in range(w)], threads) for w, p in probes.items()})
                 for i in range(rounds)]
    rows = [Row(c, predict(c, clusters[c.world]), statistics.median(sum(times[c.name], [])), sum(times[c.name], []),
                [predict(c, per_round[i][c.world]).total_s / statistics.median(times[c.name][i])
                 for i in range(rounds)])
            for c in cases]
    return Report(rows, clusters, time.monotonic() - start)


def render(report: Report) -> str:
    head = (f"{'case':<24} {'predicted':>9} {'measured':>9} {'ratio':>6}   {'compute':>8} {'dp comm':>8} "
            f"{'optim':>7} {'tp/pp':>7}  (ms; ratio: median over rounds of predicted / measured in the round)")
    lines = [head]
    for r in report.rows:
        t = r.predicted
        lines.append(f"{r.case.name:<24} {t.total_s * 1e3:9.1f} {r.measured_s * 1e3:9.1f} {r.ratio:6.2f}   "
                     f"{t.compute_s * 1e3:8.1f} {t.dp_exposed_s * 1e3:8.1f} {t.optimizer_s * 1e3:7.1f} "
                     f"{(t.tp_comm_s + t.pp_comm_s + t.bubble_s) * 1e3:7.1f}")
    for w, c in sorted(report.clusters.items()):
        lines.append(f"calibrated, {w} rank(s): linear {c.peak_flops_fp32 / 1e9:.1f} GFLOP/s, attention "
                     f"{c.attention_flops / 1e9:.1f} GFLOP/s, gelu {c.activation_s * 1e9:.2f} ns/el, norm "
                     f"{c.norm_s * 1e9:.2f} ns/el, per layer {c.layer_overhead_s * 1e3:.2f} ms + "
                     f"{c.microbatch_overhead_s * 1e3:.2f} ms, adam "
                     f"{28 / c.memory_bw * 1e9:.2f} ns/param ({28 / c.cache_bw * 1e9:.2f} in cache) + "
                     f"{c.optimizer_tensor_s * 1e6:.1f} us/tensor, overlap {c.comm_overlap:.2f}, "
                     f"all-reduce {c.intra_node_bw / 1e9:.2f} GB/s + {c.intra_node_latency_s * 1e6:.0f} us/hop")
    lines.append(f"{len(report.within(0.25))} of {len(report.rows)} within 25%; {report.seconds:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int_at_least(1), default=6, help="turns of each group (default %(default)s)")
    p.add_argument("--steps", type=int_at_least(1), default=2, help="timed steps per case per round (default 2)")
    p.add_argument("--samples", type=int_at_least(1), default=2, help="timings per probe per round (default 2)")
    p.add_argument("--threads", type=int_at_least(1), default=1, help="torch threads per rank")
    p.add_argument("--json", metavar="OUT.json", help="also write the rows and the calibrated clusters")
    p.add_argument("--model-parallel", action="store_true", help="also tensor- and pipeline-parallel cases")
    args = p.parse_args(argv)
    cases = CASES + (MODEL_PARALLEL_CASES if args.model_parallel else ())
    report = run(cases, rounds=args.rounds, steps=args.steps, samples=args.samples, threads=args.threads)
    print(render(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": [{"case": asdict(r.case), "predicted_s": r.predicted.total_s,
                                 "predicted": asdict(r.predicted), "measured_s": r.measured_s, "ratio": r.ratio,
                                 "round_ratios": r.ratios, "samples_s": r.samples} for r in report.rows],
                       "clusters": {str(w): c.to_dict() for w, c in report.clusters.items()},
                       "seconds": report.seconds}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
