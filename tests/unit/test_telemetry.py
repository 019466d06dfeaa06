"""Telemetry: peak FLOP/s and memory probes, the metrics file, the summary, the progress bar, the plot."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from rich.console import Console

from shardwise.telemetry import (
    MetricsWriter,
    RunSummary,
    StepMetrics,
    TrainProgress,
    current_rss_bytes,
    mean_tokens_per_s,
    measure_matmul_peak_flops,
    model_flops_utilization,
    peak_rss_bytes,
    plot_loss_curve,
    print_summary,
    read_metrics,
    summarize_run,
)
from shardwise.telemetry.metrics import format_bytes, format_rate
from shardwise.telemetry.progress import format_update


def _step(step: int, *, loss: float = 2.0, tokens: int = 1000, step_time_s: float = 0.5,
          elapsed_s: float | None = None) -> StepMetrics:
    return StepMetrics.build(step=step, loss=loss, lr=1e-3, tokens=tokens, step_time_s=step_time_s,
                             elapsed_s=step * step_time_s if elapsed_s is None else elapsed_s,
                             flops_per_token=6e6, peak_flops=6e10, rss_bytes=123)


# -- peak probes ------------------------------------------------------------------------------------
def test_matmul_peak_flops_is_plausible_and_counts_two_flops_per_term(monkeypatch) -> None:
    torch.set_num_threads(1)
    flops = measure_matmul_peak_flops(size=128, seconds=0.05, device="cpu")
    # Any CPU core does 1e8..1e13 fp32 FLOP/s on a 128^2 matmul.
    assert 1e8 < flops < 1e13

    # With a fake clock where every matmul takes exactly 1 ms, the rate is 2 * n^3 / 1e-3.
    clock = {"t": 0.0}

    def fake_mm(a, b, out):  # noqa: ARG001
        clock["t"] += 1e-3

    monkeypatch.setattr("shardwise.telemetry.peak.time.perf_counter", lambda: clock["t"])
    monkeypatch.setattr("shardwise.telemetry.peak.torch.mm", fake_mm)
    assert measure_matmul_peak_flops(size=64, seconds=0.05, device="cpu") == pytest.approx(2 * 64**3 / 1e-3)


def test_matmul_peak_takes_the_best_sample(monkeypatch) -> None:
    # 3 warm-up calls and a 10 ms calibration call (so one call per sample), then samples of
    # 3 ms, 1 ms, 2 ms, 4 ms...: noise only adds time, so the 1 ms sample is the answer.
    durations = iter([1e-2] * 4 + [3e-3, 1e-3, 2e-3] + [4e-3] * 1000)
    clock = {"t": 0.0}

    def fake_mm(a, b, out):  # noqa: ARG001
        clock["t"] += next(durations)

    monkeypatch.setattr("shardwise.telemetry.peak.time.perf_counter", lambda: clock["t"])
    monkeypatch.setattr("shardwise.telemetry.peak.torch.mm", fake_mm)
    flops = measure_matmul_peak_flops(size=32, seconds=0.02, device="cpu")
    assert flops == pytest.approx(2 * 32**3 / 1e-3)


def test_matmul_peak_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="size"):
        measure_matmul_peak_flops(size=0)
    with pytest.raises(ValueError, match="seconds"):
        measure_matmul_peak_flops(seconds=0)


def test_rss_probes_see_a_new_allocation() -> None:
    before_peak = peak_rss_bytes()
    before = current_rss_bytes()
    block = np.ones(64 * 2**20 // 8)          # 64 MiB, touched (ones writes every page)
    after = current_rss_bytes()
    assert after - before > 32 * 2**20
    assert peak_rss_bytes() >= max(after, before_peak) - 2**20   # peak >= current (page rounding aside)
    del block


# -- metrics ----------------------------------------------------------------------------------------
def test_step_metrics_derive_rate_and_mfu() -> None:
    m = _step(1, tokens=2000, step_time_s=0.5)
    assert m.tokens_per_s == 4000
    assert m.mfu == pytest.approx(4000 * 6e6 / 6e10)
    assert model_flops_utilization(100.0, 6.0, 0.0) is None


def test_metrics_writer_appends_flushed_lines_and_reads_back(tmp_path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    writer = MetricsWriter(path, fresh=True)
    writer.write(_step(1))
    # Flushed per line: readable while the writer is still open (a crashed run keeps its steps).
    assert [r["step"] for r in read_metrics(path)] == [1]
    writer.write({"step": 2, "loss": float("nan"), "tokens": 5, "step_time_s": 1.0})
    writer.close()
    rows = read_metrics(path)
    assert rows[0]["tokens_per_s"] == 2000 and rows[0]["rss_bytes"] == 123
    assert math.isnan(rows[1]["loss"])
    assert all(isinstance(json.loads(line), dict) for line in path.read_text().splitlines())

    with MetricsWriter(path) as again:        # default appends
        again.write(_step(3))
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    with MetricsWriter(path, fresh=True) as fresh:
        fresh.write(_step(1))
    assert [r["step"] for r in read_metrics(path)] == [1]


def test_mean_tokens_per_s_skips_the_warmup_step_and_weights_by_time() -> None:
    records = [_step(1, tokens=100, step_time_s=10.0), _step(2, tokens=100, step_time_s=1.0),
               _step(3, tokens=300, step_time_s=1.0)]
    # (100 + 300) / (1 + 1): the 10 s first step is excluded; not the mean of rates (100 + 300) / 2.
    assert mean_tokens_per_s([m.__dict__ for m in records]) == pytest.approx(200.0)
    assert mean_tokens_per_s([records[0].__dict__]) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="empty"):
        mean_tokens_per_s([])


def test_summarize_run_and_json(tmp_path) -> None:
    records = [_step(i, loss=5.0 - i, tokens=1000, step_time_s=0.5 if i > 1 else 3.0) for i in (1, 2, 3)]
    rows = [m.__dict__ for m in records]
    comm = [{"op": "all_reduce", "group": "dp", "group_size": 2, "dtype": "float32", "count": 3,
             "bytes": 4096}, {"op": "broadcast", "group": "dp", "group_size": 2, "dtype": "float32",
                              "count": 1, "bytes": 1024}]
    mem = [{"params": 10, "grads": 10, "optimizer": 20, "activations": 5, "peak_rss": 2**30}] * 2
    s = summarize_run(rows, world_size=2, flops_per_token=6e6, peak_flops=1e10, memory_per_rank=mem,
                      comm_per_step=comm)
    assert s.steps == 3 and s.final_loss == 2.0 and s.mean_tokens_per_s == pytest.approx(2000.0)
    assert s.mfu == pytest.approx(2000 * 6e6 / 1e10)
    assert s.comm_bytes_per_step == 5120
    saved = json.loads(s.write_json(tmp_path / "summary.json").read_text())
    assert saved["comm_bytes_per_step"] == 5120 and saved["memory_per_rank"][1]["peak_rss"] == 2**30
    assert RunSummary(**{k: v for k, v in saved.items() if k != "comm_bytes_per_step"}) == s


def test_step_metrics_carry_grad_norm_loss_scale_and_skips(tmp_path) -> None:
    m = StepMetrics.build(step=4, loss=3.0, lr=1e-3, tokens=64, step_time_s=0.5, elapsed_s=2.0, flops_per_token=6e6,
                          peak_flops=1e10, rss_bytes=1, grad_norm=float("inf"), loss_scale=32768.0, skipped_steps=2)
    with MetricsWriter(tmp_path / "m.jsonl", fresh=True) as w:
        w.write(_step(3))
        w.write(m)
    rows = read_metrics(tmp_path / "m.jsonl")
    assert rows[1]["grad_norm"] == float("inf") and rows[1]["loss_scale"] == 32768.0 and rows[1]["skipped_steps"] == 2
    s = summarize_run(rows, world_size=1, flops_per_token=6e6, peak_flops=1e10)
    assert (s.final_grad_norm, s.final_loss_scale, s.skipped_steps) == (float("inf"), 32768.0, 2)
    # A file from before these fields existed still summarizes.
    old = [{k: v for k, v in r.items() if k not in ("grad_norm", "loss_scale", "skipped_steps")} for r in rows]
    s = summarize_run(old, world_size=1, flops_per_token=6e6, peak_flops=1e10)
    assert (s.final_grad_norm, s.final_loss_scale, s.skipped_steps) == (None, 1.0, 0)


def test_moe_figures_are_in_the_row_and_the_progress_line_only_for_an_moe_model(tmp_path) -> None:
    moe = {"moe_tokens_per_expert": [[30, 10, 0, 0], [10, 10, 10, 0]], "moe_dropped_tokens": 10,
           "moe_aux_loss": 1.25, "moe_z_loss": 0.5}
    m = StepMetrics.build(step=1, loss=3.0, lr=1e-3, tokens=64, step_time_s=0.5, elapsed_s=0.5, flops_per_token=6e6,
                          peak_flops=1e10, rss_bytes=1, moe=moe)
    with MetricsWriter(tmp_path / "m.jsonl", fresh=True) as w:
        w.write(m)
        w.write(_step(2))
    rows = read_metrics(tmp_path / "m.jsonl")
    assert {k: rows[0][k] for k in moe} == moe
    assert not any(k.startswith("moe_") for k in rows[1])
    # 10 of 80 choices dropped (70 ran); the first layer's busiest expert ran 30 of 40: 3x the mean of 10
    assert format_update(m).endswith(" | moe drop 12.5% load 3.00 aux 1.25 z 0.5")
    assert "moe" not in format_update(_step(2))


def test_formatters() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_rate(12_345_678) == "12.3M"
    assert format_rate(2.5e12, "FLOP/s") == "2.5TFLOP/s"
    assert format_rate(12.0) == "12.0"


# -- progress and summary ---------------------------------------------------------------------------
def _console(*, terminal: bool) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=terminal, width=140, color_system=None), buf


def test_progress_disabled_prints_nothing() -> None:
    console, buf = _console(terminal=True)
    with TrainProgress(5, enabled=False, console=console) as progress:
        for i in range(1, 6):
            progress.update(_step(i))
    assert buf.getvalue() == ""


def test_progress_without_terminal_prints_plain_lines_at_the_cadence() -> None:
    console, buf = _console(terminal=False)
    with TrainProgress(25, enabled=True, steps_per_print=10, console=console) as progress:
        for i in range(1, 26):
            progress.update(_step(i, loss=3.0 - 0.01 * i, step_time_s=0.5))
    lines = buf.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1/25", "step 10/25", "step 20/25", "step 25/25"]
    assert "\x1b" not in buf.getvalue()          # no control codes in a log file
    assert "loss 2.9000" in lines[1] and "tok/s" in lines[1] and "MFU 20.0%" in lines[1]
    assert "ETA 0:00:08" in lines[1] and "ETA 0:00:02" in lines[2]   # 15 and 5 steps left at 0.5 s (rounded half-even)
    assert "ETA 0:00:00" in lines[3]


def test_progress_eta_leaves_out_the_warmup_step() -> None:
    progress = TrainProgress(10, enabled=True, console=_console(terminal=False)[0])
    assert progress.eta_s() is None
    progress.update(_step(1, step_time_s=30.0))
    assert progress.eta_s() == pytest.approx(9 * 30.0)        # only the warm-up step is known
    progress.update(_step(2, step_time_s=1.0))
    progress.update(_step(3, step_time_s=2.0))
    assert progress.eta_s() == pytest.approx(7 * 1.5)


def test_progress_live_bar_on_a_terminal_shows_the_fields() -> None:
    console, buf = _console(terminal=True)
    with TrainProgress(3, enabled=True, console=console) as progress:
        assert progress.live
        for i in range(1, 4):
            progress.update(_step(i, loss=1.25))
    out = buf.getvalue()
    assert "3/3" in out and "loss 1.2500" in out and "tok/s" in out and "MFU 20.0%" in out and "ETA" in out


def test_print_summary_shows_every_figure() -> None:
    rows = [_step(i, loss=4.0 / i).__dict__ for i in (1, 2)]
    rows[-1].update(grad_norm=0.8125, loss_scale=1024.0, skipped_steps=3)
    mem = [{"params": 2**20, "grads": 2**20, "optimizer": 2**21, "activations": 2**22, "peak_rss": 2**30},
           {"params": 2**20, "grads": 2**20, "optimizer": 2**21, "activations": 2**22, "peak_rss": 2**31}]
    comm = [{"op": "all_reduce", "group": "dp", "group_size": 2, "dtype": "float32", "count": 4,
             "bytes": 3 * 2**20}]
    s = summarize_run(rows, world_size=2, flops_per_token=6e6, peak_flops=6e10, memory_per_rank=mem,
                      comm_per_step=comm)
    console, buf = _console(terminal=False)
    print_summary(s, console=console)
    out = buf.getvalue()
    for expected in ("final loss", "2.0000", "mean tokens/s", "2.0k", "MFU", "20.0%", "Memory per rank",
                     "1.0 GiB", "2.0 GiB", "4.0 MiB", "all_reduce", "3.0 MiB", "peak RSS", "final gradient norm",
                     "0.8125", "final loss scale", "1024", "skipped steps"):
        assert expected in out, expected


# -- plot -------------------------------------------------------------------------------------------
def test_plot_loss_curve_writes_a_png(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    with MetricsWriter(metrics) as w:
        for i in range(1, 41):
            w.write(_step(i, loss=5.0 * math.exp(-i / 15) + 0.1 * math.sin(i), step_time_s=0.4 + 0.01 * (i % 3)))
        w.write({**_step(41).__dict__, "loss": float("inf")})    # a non-finite step is skipped, not plotted
    out = plot_loss_curve(metrics, tmp_path / "plots" / "loss.png", title="tiny on stdlib")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_loss_curve_rejects_an_empty_file(tmp_path) -> None:
    empty = tmp_path / "metrics.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no step records"):
        plot_loss_curve(empty, tmp_path / "loss.png")
