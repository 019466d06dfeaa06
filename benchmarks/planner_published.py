"""The planner's step time against published large-scale training results it was not fitted to.

    python -m benchmarks.planner_published              # per-row table and error statistics
    python -m benchmarks.planner_published --json out.json

Rows (A100 80 GB, DGX A100 nodes of 8 on HDR InfiniBand: the `a100-80gb` preset; GPT shapes with a
51,200-token vocabulary, 2,048-token sequences, tied embeddings, learned positions, biases):

- Narayanan et al. 2021 (arXiv:2104.04473) Table 1: weak scaling of PTD-P (Megatron) from 1.7B to 1T,
  teraFLOP/s per GPU counted with eq. 3 (full recomputation). The table gives no micro-batch size; 1 is
  used (what the paper's Table 2 and Korthikanti et al. use for the same models).
- Narayanan et al. 2021 Table 2: ZeRO-3 (DeepSpeed, no model parallelism) against PTD-P for the 175B and
  530B models at three GPU counts, teraFLOP/s per GPU.
- Korthikanti et al. 2022 (arXiv:2205.05198) Table 5: iteration time of 22B, 175B, 530B and 1T with full
  recomputation and with sequence parallelism + selective recomputation (Table 3 gives the layouts).

Fitting: `FIT` names the rows the preset's two fitted figures came from, half of each table's PTD-P rows for
compute_efficiency (alternate rows: Table 1's 1.7B, 7.5B, 39.1B, 145.6B, 529.6B; Table 5's 22B and 530B full,
175B and 1T selective) and Table 2's ZeRO-3 175B row on 1,536 GPUs for gather_efficiency. Every other row is
a prediction. How the jobs ran, taken from the papers: Megatron 2021 reduces gradients
after the backward (no overlap) and sends 1/t of each pipeline activation (scatter/gather); DeepSpeed's ZeRO-3
gathers parameters module by module, prefetches (its default bucket of 50M elements) and, by its default
`overlap_comm: false`, reduce-scatters gradients after each module's backward rather than behind it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass

from shardwise.planner.flops import iteration_flops
from shardwise.planner.memory import memory_per_rank
from shardwise.planner.presets import cluster_preset
from shardwise.models.presets import GPTConfig
from shardwise.planner.specs import ClusterSpec, JobSpec, Plan, Recompute, Zero3Gather
from shardwise.planner.time import step_time

VOCAB, SEQ = 51200, 2048


def gpt(layers: int, hidden: int, heads: int) -> GPTConfig:
    """The papers' GPT: 4h GELU MLP, biases, learned positions, tied head, dropout (its masks are stored)."""
    return GPTConfig(n_layer=layers, d_model=hidden, n_head=heads, vocab_size=VOCAB, seq_len=SEQ,
                     tie_embeddings=True, dropout=0.1)


MODELS = {  # the papers' names
    "1.7B": gpt(24, 2304, 24), "3.6B": gpt(30, 3072, 32), "7.5B": gpt(36, 4096, 32), "18.4B": gpt(40, 6144, 48),
    "39.1B": gpt(48, 8192, 64), "76.1B": gpt(60, 10240, 80), "145.6B": gpt(80, 12288, 96),
    "310.1B": gpt(96, 16384, 128), "529.6B": gpt(105, 20480, 128), "1008.0B": gpt(128, 25600, 160),
    "22B": gpt(48, 6144, 64), "175B": gpt(96, 12288, 96), "530B": gpt(105, 20480, 128), "1T": gpt(128, 25600, 160)}


@dataclass(frozen=True)
class Row:
    """One published result: `value` is teraFLOP/s per GPU (eq. 3 count) or seconds per iteration."""

    source: str            # paper, table, row
    model: str
    gpus: int
    batch: int
    tp: int
    pp: int
    value: float
    unit: str = "tflops"   # or "s"
    zero3: bool = False
    selective_sp: bool = False

    @property
    def key(self) -> str:
        scheme = "zero3" if self.zero3 else ("sp+sel" if self.selective_sp else "ptd-p")
        return f"{self.model} {scheme} n{self.gpus}"


N21_T1, N21_T2, K22_T5 = "Narayanan 2021 Table 1", "Narayanan 2021 Table 2", "Korthikanti 2022 Table 5"
ROWS: tuple[Row, ...] = (
    Row(N21_T1, "1.7B", 32, 512, 1, 1, 137), Row(N21_T1, "3.6B", 64, 512, 2, 1, 138),
    Row(N21_T1, "7.5B", 128, 512, 4, 1, 142), Row(N21_T1, "18.4B", 256, 1024, 8, 1, 135),
    Row(N21_T1, "39.1B", 512, 1536, 8, 2, 138), Row(N21_T1, "76.1B", 1024, 1792, 8, 4, 140),
    Row(N21_T1, "145.6B", 1536, 2304, 8, 8, 148), Row(N21_T1, "310.1B", 1920, 2160, 8, 16, 155),
    Row(N21_T1, "529.6B", 2520, 2520, 8, 35, 163), Row(N21_T1, "1008.0B", 3072, 3072, 8, 64, 163),
    Row(N21_T2, "175B", 384, 1536, 1, 1, 144, zero3=True), Row(N21_T2, "175B", 768, 1536, 1, 1, 88, zero3=True),
    Row(N21_T2, "175B", 1536, 1536, 1, 1, 44, zero3=True),
    Row(N21_T2, "530B", 640, 2560, 1, 1, 138, zero3=True), Row(N21_T2, "530B", 1280, 2560, 1, 1, 98, zero3=True),
    Row(N21_T2, "530B", 2560, 2560, 1, 1, 48, zero3=True),
    Row(N21_T2, "175B", 384, 1536, 8, 12, 153), Row(N21_T2, "175B", 768, 1536, 8, 12, 149),
    Row(N21_T2, "175B", 1536, 1536, 8, 12, 141),
    Row(N21_T2, "530B", 560, 2240, 8, 35, 171), Row(N21_T2, "530B", 1120, 2240, 8, 35, 167),
    Row(N21_T2, "530B", 2240, 2240, 8, 35, 159),
    Row(K22_T5, "22B", 8, 4, 8, 1, 1.42, "s"), Row(K22_T5, "22B", 8, 4, 8, 1, 1.10, "s", selective_sp=True),
    Row(K22_T5, "175B", 64, 64, 8, 8, 18.13, "s"), Row(K22_T5, "175B", 64, 64, 8, 8, 13.75, "s", selective_sp=True),
    Row(K22_T5, "530B", 280, 280, 8, 35, 49.05, "s"), Row(K22_T5, "530B", 280, 280, 8, 35, 37.83, "s",
                                                           selective_sp=True),
    Row(K22_T5, "1T", 512, 512, 8, 64, 94.42, "s"), Row(K22_T5, "1T", 512, 512, 8, 64, 71.49, "s", selective_sp=True),
)
FIT = frozenset({"1.7B ptd-p n32", "7.5B ptd-p n128", "39.1B ptd-p n512", "145.6B ptd-p n1536",
                 "529.6B ptd-p n2520", "22B ptd-p n8", "175B sp+sel n64", "530B ptd-p n280", "1T sp+sel n512",
                 "175B zero3 n1536"})
"""The rows the preset's fitted figures came from; the rest are predictions."""


def job_and_plan(row: Row) -> tuple[JobSpec, Plan]:
    """How the paper ran the row: Megatron (no DP overlap, pipeline scatter/gather) or DeepSpeed ZeRO-3
    (micro-batch = batch / GPUs, per-module gathers, overlapped reduction)."""
    dp = row.gpus // (row.tp * row.pp)
    if row.zero3:
        job = JobSpec(global_batch=row.batch, zero3_gather=Zero3Gather.MODULE, overlap_dp_comm=False)
        return job, Plan(dp=dp, zero_stage=3, micro_batch=row.batch // dp, recompute=Recompute.FULL)
    job = JobSpec(global_batch=row.batch, overlap_dp_comm=False, pp_scatter_gather=True)
    recompute = Recompute.SELECTIVE if row.selective_sp else Recompute.FULL
    return job, Plan(dp=dp, tp=row.tp, pp=row.pp, micro_batch=1, recompute=recompute,
                     sequence_parallel=row.selective_sp)


@dataclass(frozen=True)
class Prediction:
    row: Row
    predicted: float
    fits: bool

    @property
    def ratio(self) -> float:
        """Predicted over published throughput (for a time, published over predicted): > 1 over-predicts."""
        return self.predicted / self.row.value if self.row.unit == "tflops" else self.row.value / self.predicted

    @property
    def fitted(self) -> bool:
        return self.row.key in FIT


def predict(row: Row, cluster: ClusterSpec | None = None) -> Prediction:
    base = cluster or cluster_preset("a100-80gb")
    cluster = base.replace(num_gpus=row.gpus)
    model = MODELS[row.model]
    job, plan = job_and_plan(row)
    t = step_time(model, cluster, job, plan)
    fits = memory_per_rank(model, cluster, job, plan).fits
    if row.unit == "s":
        return Prediction(row, t.total_s, fits)
    # the papers' count: eq. 3, four forwards of the blocks (recomputation) and three of the logits
    flops = iteration_flops(model, batch=row.batch, seq_len=SEQ, recompute=Recompute.FULL)
    return Prediction(row, flops / (t.total_s * row.gpus) / 1e12, fits)


def predict_all(cluster: ClusterSpec | None = None) -> list[Prediction]:
    return [predict(r, cluster) for r in ROWS]


@dataclass(frozen=True)
class Stats:
    rows: int
    mean_abs: float     # mean |predicted / published - 1|
    worst: float
    bias: float         # mean of (predicted / published - 1)
    trend: float        # least-squares slope of log(ratio) against log(parameters), Table 1 rows


def stats(preds: list[Prediction]) -> Stats:
    errors = [p.ratio - 1 for p in preds]
    t1 = [p for p in preds if p.row.source == N21_T1]
    trend = 0.0
    if len(t1) > 1:
        xs = [math.log(float(p.row.model.rstrip("B"))) for p in t1]
        ys = [math.log(p.ratio) for p in t1]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        trend = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return Stats(len(preds), statistics.fmean(abs(e) for e in errors), max(abs(e) for e in errors),
                 statistics.fmean(errors), trend)


def ranking_agrees(preds: list[Prediction]) -> dict[str, bool]:
    """Table 2: for each model and GPU count, the paper's winner (PTD-P) is the planner's."""
    out = {}
    for model, rank_pairs in (("175B", ((384, 384), (768, 768), (1536, 1536))),
                              ("530B", ((640, 560), (1280, 1120), (2560, 2240)))):
        for z_gpus, p_gpus in rank_pairs:
            z = next(p for p in preds if p.row.zero3 and p.row.model == model and p.row.gpus == z_gpus)
            d = next(p for p in preds if p.row.source == N21_T2 and not p.row.zero3 and p.row.model == model
                     and p.row.gpus == p_gpus)
            paper = d.row.value > z.row.value
            out[f"{model} n{z_gpus}/{p_gpus}"] = (d.predicted > z.predicted) == paper
    return out


def render(preds: list[Prediction]) -> str:
    # error: predicted over published throughput - 1 (for an iteration time, published over predicted - 1)
    lines = [f"{'source':25} {'row':24} {'published':>9} {'predicted':>9} {'error':>7}  fit  fits"]
    for p in preds:
        unit = "TF" if p.row.unit == "tflops" else " s"
        lines.append(f"{p.row.source:25} {p.row.key:24} {p.row.value:>7.2f}{unit} {p.predicted:>7.2f}{unit} "
                     f"{100 * (p.ratio - 1):>+6.1f}%  {'yes' if p.fitted else '   '}  {'yes' if p.fits else 'no'}")
    held = [p for p in preds if not p.fitted]
    for name, group in (("all rows", preds), ("held-out rows", held)):
        s = stats(group)
        lines.append(f"{name}: {s.rows} rows, mean |error| {100 * s.mean_abs:.1f}%, worst {100 * s.worst:.1f}%, "
                     f"bias {100 * s.bias:+.1f}%")
    lines.append(f"Table 1 trend: d log(predicted/published) / d log(params) = {stats(preds).trend:+.3f}")
    agree = ranking_agrees(preds)
    lines.append(f"Table 2 ranking (PTD-P faster than ZeRO-3) as the paper: {sum(agree.values())}/{len(agree)}")
    return "\n".join(lines)


def fit(base: ClusterSpec | None = None) -> tuple[float, float]:
    """The two fitted figures of the preset, from the `FIT` rows only: compute_efficiency minimising the mean
    squared log error of the fitted Table 1 rows (a grid of 0.005 steps), then gather_efficiency matching the
    fitted ZeRO-3 row (bisection; throughput rises with it)."""
    base = base or cluster_preset("a100-80gb")
    ptdp = [r for r in ROWS if r.key in FIT and not r.zero3]

    def loss(e: float) -> float:
        c = base.replace(compute_efficiency=e)
        return sum(math.log(predict(r, c).ratio) ** 2 for r in ptdp)
    compute = min((0.30 + 0.005 * i for i in range(141)), key=loss)
    zero3 = next(r for r in ROWS if r.key in FIT and r.zero3)
    lo, hi = 0.05, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        ratio = predict(zero3, base.replace(compute_efficiency=compute, gather_efficiency=mid)).ratio
        lo, hi = (mid, hi) if ratio < 1 else (lo, mid)
    return round(compute, 3), round((lo + hi) / 2, 3)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="OUT.json", help="also write every row as JSON")
    p.add_argument("--fit", action="store_true", help="print the fitted figures (from the FIT rows) first")
    args = p.parse_args(argv)
    if args.fit:
        compute, gather = fit()
        print(f"fitted on {sorted(FIT)}: compute_efficiency {compute}, gather_efficiency {gather}")
    preds = predict_all()
    print(render(preds))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{"source": x.row.source, "row": x.row.key, "published": x.row.value, "unit": x.row.unit,
                        "predicted": x.predicted, "fitted": x.fitted, "fits": x.fits} for x in preds], f, indent=2)


if __name__ == "__main__":
    main()
