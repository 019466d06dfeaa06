"""Training curves as a PNG against the step: training loss and, when the run evaluated, held-out loss (top
panel), learning rate (middle) and throughput (bottom).

Matplotlib's Agg backend renders without a display, so this works on headless machines and inside
launched ranks. The figure is built on an explicit `Figure` object (not `pyplot`), so no global
figure state is created or leaked across calls.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from shardwise.telemetry.metrics import final_history, read_metrics


def plot_loss_curve(metrics_path: str | os.PathLike[str], png_path: str | os.PathLike[str], *,
                    title: str | None = None) -> Path:
    """Read a metrics.jsonl file and write its loss and tokens/s curves to `png_path`.

    Steps with a non-finite loss (an fp16 overflow, a divergence) are left out of the loss line
    rather than stretching the axis to infinity. Returns the path written.
    """
    records = final_history(read_metrics(metrics_path))
    if not records:
        raise ValueError(f"{metrics_path} has no step records: nothing to plot")
    steps = [int(r["step"]) for r in records]
    finite = [(s, float(r["loss"])) for s, r in zip(steps, records) if math.isfinite(float(r["loss"]))]

    fig = Figure(figsize=(8, 7.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, lr_ax, rate_ax = fig.subplots(3, 1, sharex=True, height_ratios=(2, 1, 1))

    loss_ax.plot([s for s, _ in finite], [v for _, v in finite], color="tab:blue", lw=1.2, alpha=0.75,
                 marker="o" if len(finite) <= 30 else None, ms=3, label="loss")
    if len(finite) >= 20:
        # A trailing mean shows the trend through the step-to-step noise of small batches.
        window = max(5, len(finite) // 10)
        values = [v for _, v in finite]
        smooth = []
        for i in range(len(values)):
            chunk = values[max(0, i - window + 1):i + 1]
            smooth.append(sum(chunk) / len(chunk))
        loss_ax.plot([s for s, _ in finite], smooth, color="tab:orange", lw=2,
                     label=f"mean of last {window}")
        loss_ax.legend(loc="upper right")
    evals = [(s, float(r["eval_loss"])) for s, r in zip(steps, records)
             if r.get("eval_loss") is not None and math.isfinite(float(r["eval_loss"]))]
    if evals:
        loss_ax.plot([s for s, _ in evals], [v for _, v in evals], color="tab:red", lw=1.5, marker="s", ms=4,
                     label="eval loss (held out)")
        loss_ax.annotate(f"eval {evals[-1][1]:.3f}", xy=evals[-1], xytext=(-10, -16), textcoords="offset points",
                         ha="right", fontsize=9, color="tab:red")
        loss_ax.legend(loc="upper right")
    loss_ax.set_ylabel("loss")
    loss_ax.grid(alpha=0.3)
    if finite:
        loss_ax.annotate(f"final {finite[-1][1]:.3f}", xy=finite[-1], xytext=(-10, 12),
                         textcoords="offset points", ha="right", fontsize=9)

    lr_ax.plot(steps, [float(r["lr"]) for r in records], color="tab:purple", lw=1.2)
    lr_ax.set_ylabel("learning rate")
    lr_ax.grid(alpha=0.3)
    lr_ax.set_ylim(bottom=0)

    rates = [float(r["tokens_per_s"]) for r in records]
    rate_ax.plot(steps, rates, color="tab:green", lw=1.2, marker="o" if len(steps) <= 30 else None, ms=3)
    rate_ax.set_ylabel("tokens / s")
    rate_ax.set_xlabel("optimizer step")
    rate_ax.grid(alpha=0.3)
    rate_ax.set_ylim(bottom=0)
    rate_ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    fig.suptitle(title or f"Training loss over {steps[-1]} steps")
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    return png_path
