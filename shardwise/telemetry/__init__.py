"""Telemetry of a training run: per-step metrics (tokens/s, MFU, memory), the progress bar, the
summary table and the loss plot; the engine's monitor (DeepSpeed's monitors, timers, comms logger and
flops profiler: `monitor.py`).

Names resolve lazily, so the engine importing `shardwise.telemetry.monitor` does not pull in matplotlib
and rich, which only the CLI's table and plot need."""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "MetricsWriter": "metrics", "RunSummary": "metrics", "StepMetrics": "metrics", "final_history": "metrics",
    "mean_tokens_per_s": "metrics", "model_flops_utilization": "metrics", "read_metrics": "metrics",
    "summarize_run": "metrics",
    "current_rss_bytes": "peak", "measure_matmul_peak_flops": "peak", "peak_rss_bytes": "peak",
    "plot_loss_curve": "plots",
    "TrainProgress": "progress", "print_summary": "progress",
    "TrainingMonitor": "monitor",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'shardwise.telemetry' has no attribute {name!r}")
    return getattr(importlib.import_module(f"shardwise.telemetry.{_HOME[name]}"), name)
