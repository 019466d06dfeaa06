"""Per-step training metrics, their JSON-lines file, and the end-of-run summary.

One line of `metrics.jsonl` per optimizer step (`StepMetrics`), written by global rank 0:

    {"step": 3, "loss": 4.91, "lr": 0.0003, "tokens": 1024, "tokens_per_s": 8211.5, "mfu": 0.031,
     "step_time_s": 0.1247, "elapsed_s": 0.52, "rss_bytes": 412712960, "grad_norm": 1.83,
     "loss_scale": 65536.0, "skipped_steps": 0, "skipped": false}
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence


def model_flops_utilization(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float | None:
    """Achieved model FLOP/s over peak FLOP/s; None when the peak is unknown (<= 0).

    `flops_per_token` is the model's training cost per token (forward + backward, no recompute):
    MFU deliberately ignores recomputation, which is work the hardware does but the model does not need.
    """
    if peak_flops <= 0:
        return None
    return tokens_per_s * flops_per_token / peak_flops


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one optimizer step did, as seen by global rank 0.

    `grad_norm` is `engine.updater.last_grad_norm`: Infinity for a step skipped on inf/nan gradients, null when
    gradient_clipping is 0 and no norm is taken; `loss_scale` is 1.0 unless fp16; `skipped` means fp16 overflow:
    the parameters did not move. `tokens` and `tokens_per_s` count the whole job (all data-parallel ranks), so
    MFU divides by the peak of all ranks together. A step after which the run evaluated also holds `eval_loss`
    (mean cross-entropy on the held-out split), `eval_perplexity` (its exp) and what they averaged over:
    `eval_windows` windows, `eval_tokens` predictions, in its line.
    """

    step: int
    loss: float
    lr: float                 # learning rate of the update this step applied (first param group)
    tokens: int               # tokens of this step over all ranks: train_batch_size * seq_len
    tokens_per_s: float
    mfu: float | None
    step_time_s: float        # wall time of engine.train_batch on rank 0
    elapsed_s: float          # since the first step started
    rss_bytes: int            # resident memory of rank 0 after the step
    grad_norm: float | None = None   # the whole model's gradient norm before clipping
    loss_scale: float = 1.0          # the fp16 loss scale after the step
    skipped_steps: int = 0           # steps skipped so far (inf/nan gradients)
    skipped: bool = False            # this step's update was skipped
    # A model with MoE layers (`parallel/experts/metrics.py`); None otherwise, and then left out of its row.
    moe_tokens_per_expert: list[list[int]] | None = None   # per MoE layer, (token, choice) pairs each expert ran
    moe_dropped_tokens: int | None = None                  # (token, choice) pairs dropped over capacity
    moe_aux_loss: float | None = None                      # load-balancing loss (no coefficient), mean over layers
    moe_z_loss: float | None = None                        # router z-loss likewise

    def row(self) -> dict[str, Any]:
        """Its metrics.jsonl row: every field, the MoE ones only for a model with MoE layers."""
        return {k: v for k, v in asdict(self).items() if not (k.startswith("moe_") and v is None)}

    @classmethod
    def build(cls, *, step: int, loss: float, lr: float, tokens: int, step_time_s: float, elapsed_s: float,
              flops_per_token: float, peak_flops: float, rss_bytes: int, grad_norm: float | None = None,
              loss_scale: float = 1.0, skipped_steps: int = 0, skipped: bool = False,
              moe: dict[str, Any] | None = None) -> "StepMetrics":
        """Derive tokens/s and MFU from the raw counts of one step."""
        tokens_per_s = tokens / step_time_s if step_time_s > 0 else 0.0
        return cls(step=step, loss=float(loss), lr=float(lr), tokens=tokens, tokens_per_s=tokens_per_s,
                   mfu=model_flops_utilization(tokens_per_s, flops_per_token, peak_flops),
                   step_time_s=step_time_s, elapsed_s=elapsed_s, rss_bytes=rss_bytes,
                   grad_norm=None if grad_norm is None else float(grad_norm), loss_scale=float(loss_scale),
                   skipped_steps=int(skipped_steps), skipped=bool(skipped), **(moe or {}))


class MetricsWriter:
    """Append one JSON object per line to `path`, flushed after every line.

    Flushing each line means a crashed or interrupted run still leaves every finished step on disk,
    and `tail -f metrics.jsonl` follows a live run. `fresh=True` truncates a file left by an earlier
    run into the same directory, so one file never mixes two runs. Non-finite losses are written as JSON
    `NaN`/`Infinity` (Python reads them back).
    """

    def __init__(self, path: str | os.PathLike[str], *, fresh: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w" if fresh else "a", encoding="utf-8")

    def write(self, record: StepMetrics | Mapping[str, Any]) -> None:
        row = record.row() if isinstance(record, StepMetrics) else dict(record)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics file, in file order; blank lines are skipped."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


DROPPED_SUFFIX = ".dropped.jsonl"


def drop_rows_after(path: str | os.PathLike[str], step: int) -> int:
    """Keep in `path` (a metrics file) only the rows of steps <= `step`, the ones whose weights a run resumed
    from the checkpoint of `step` holds; the rows after it (an attempt that died, or a run resumed from an
    earlier tag) are appended to PATH's `.dropped.jsonl` side file for the record. Returns how many moved.

    The side file is appended and flushed before the metrics file is replaced (write and rename), so a crash
    in between keeps every row at least once. Lines that are not JSON objects with a step stay where they are."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            row = json.loads(line)
            later = isinstance(row, dict) and int(row["step"]) > step
        except (ValueError, KeyError, TypeError):
            later = False
        (dropped if later else kept).append(line if line.endswith("\n") else line + "\n")
    if not dropped:
        return 0
    side = path.with_name(path.name.removesuffix(".jsonl") + DROPPED_SUFFIX)
    with open(side, "a", encoding="utf-8") as f:
        f.writelines(dropped)
        f.flush()
        os.fsync(f.fileno())
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(dropped)


def final_history(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The steps the run's final state went through, one record each. A resumed run appends to its file and
    may redo steps written after its last checkpoint: a record of step s drops the records of steps >= s
    written before it (that history was abandoned)."""
    kept: list[Mapping[str, Any]] = []
    for record in records:
        while kept and int(kept[-1]["step"]) >= int(record["step"]):
            kept.pop()
        kept.append(record)
    return kept


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """The figures a run reports at the end (printed as a table, saved as summary.json)."""

    steps: int
    final_loss: float
    mean_tokens_per_s: float      # over steps 2..S: step 1 pays for warm-up (allocation, first kernels)
    mfu: float | None
    total_time_s: float
    world_size: int
    tokens_per_step: int
    flops_per_token: float
    peak_flops: float             # all ranks together (the MFU denominator)
    memory_per_rank: list[dict[str, int]] = field(default_factory=list)   # rank order, bytes
    comm_per_step: list[dict[str, Any]] = field(default_factory=list)     # one row per (op, group, dtype)
    final_grad_norm: float | None = None    # the last step's gradient norm
    final_loss_scale: float = 1.0
    skipped_steps: int = 0                  # over the whole run
    final_eval_loss: float | None = None    # the last evaluation's held-out loss (None: the run did not evaluate)
    final_eval_perplexity: float | None = None
    final_eval_windows: int | None = None   # the windows it averaged over (None: not recorded)

    @property
    def comm_bytes_per_step(self) -> int:
        return sum(int(row.get("bytes", 0)) for row in self.comm_per_step)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["comm_bytes_per_step"] = self.comm_bytes_per_step
        return out

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path


def mean_tokens_per_s(records: Sequence[Mapping[str, Any]]) -> float:
    """Time-weighted mean throughput: total tokens / total time over every step but the first.

    The first step pays one-time costs (allocator growth, thread pools, first collectives), so it is
    left out whenever there is another step. Summing before dividing weights each step by its duration,
    which is what "tokens per second of training" means (a mean of per-step rates would not be).
    """
    if not records:
        raise ValueError("no step records: cannot compute tokens/s of an empty run")
    steady = records[1:] if len(records) > 1 else records
    seconds = sum(float(r["step_time_s"]) for r in steady)
    return sum(int(r["tokens"]) for r in steady) / seconds if seconds > 0 else 0.0


def summarize_run(records: Sequence[Mapping[str, Any]], *, world_size: int, flops_per_token: float,
                  peak_flops: float, memory_per_rank: Sequence[Mapping[str, int]] = (),
                  comm_per_step: Sequence[Mapping[str, Any]] = ()) -> RunSummary:
    """Fold the per-step records of a run (as written by MetricsWriter) into a RunSummary."""
    throughput = mean_tokens_per_s(records)
    last = records[-1]
    evaluated = [r for r in records if r.get("eval_loss") is not None]
    return RunSummary(
        steps=int(last["step"]), final_loss=float(last["loss"]), mean_tokens_per_s=throughput,
        mfu=model_flops_utilization(throughput, flops_per_token, peak_flops),
        total_time_s=float(last["elapsed_s"]), world_size=world_size, tokens_per_step=int(last["tokens"]),
        flops_per_token=flops_per_token, peak_flops=peak_flops,
        memory_per_rank=[{k: int(v) for k, v in m.items()} for m in memory_per_rank],
        comm_per_step=[dict(row) for row in comm_per_step],
        # Files written before these fields existed read as "unknown" / the defaults.
        final_grad_norm=None if last.get("grad_norm") is None else float(last["grad_norm"]),
        final_loss_scale=float(last.get("loss_scale", 1.0)), skipped_steps=int(last.get("skipped_steps", 0)),
        final_eval_loss=float(evaluated[-1]["eval_loss"]) if evaluated else None,
        final_eval_perplexity=float(evaluated[-1]["eval_perplexity"]) if evaluated else None,
        final_eval_windows=int(evaluated[-1]["eval_windows"]) if evaluated and "eval_windows" in evaluated[-1]
        else None,
    )


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, as memory is allocated in them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_rate(x: float, unit: str = "") -> str:
    """12_345_678 -> '12.3M'; SI prefixes for rates (FLOP/s, tokens/s)."""
    if not math.isfinite(x):
        return str(x)
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{prefix}{unit}"
    return f"{x:.1f}{unit}"
