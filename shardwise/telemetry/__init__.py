"""Telemetry of a training run: per-step metrics (tokens/s, MFU, memory), the progress bar, the
summary table and the loss plot."""

from shardwise.telemetry.metrics import (
    MetricsWriter,
    RunSummary,
    StepMetrics,
    mean_tokens_per_s,
    model_flops_utilization,
    read_metrics,
    summarize_run,
)
from shardwise.telemetry.peak import current_rss_bytes, measure_matmul_peak_flops, peak_rss_bytes
from shardwise.telemetry.plots import plot_loss_curve
from shardwise.telemetry.progress import TrainProgress, print_summary

__all__ = [
    "MetricsWriter",
    "RunSummary",
    "StepMetrics",
    "TrainProgress",
    "current_rss_bytes",
    "mean_tokens_per_s",
    "measure_matmul_peak_flops",
    "model_flops_utilization",
    "peak_rss_bytes",
    "plot_loss_curve",
    "print_summary",
    "read_metrics",
    "summarize_run",
]
