"""The MFU denominator: measured once per machine and dtype, cached, overridable, and never below the achieved
rate; the progress line shows the gradient norm, loss scale and skipped steps."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from shardwise.telemetry import StepMetrics, TrainProgress
from shardwise.telemetry import peak_cache as pc

CPU = torch.device("cpu")


class CountingSource:
    """A peak source that answers `value` and counts its calls (a real measurement takes a second)."""

    def __init__(self, value: float, origin: str = "measured"):
        self.value, self.origin, self.calls = value, origin, []

    def __call__(self, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
        self.calls.append((device, dtype))
        return self.value, self.origin


def test_measured_once_then_read_from_the_cache_per_dtype(tmp_path) -> None:
    cache = pc.PeakCache(tmp_path / "peak.json")
    source = CountingSource(3e10)
    first = pc.resolve_peak(device=CPU, dtype=torch.float32, source=source, cache=cache)
    again = pc.resolve_peak(device=CPU, dtype=torch.float32, source=CountingSource(9e10), cache=cache)
    assert (first.origin, first.flops) == (pc.PeakOrigin.MEASURED, 3e10)
    assert (again.origin, again.flops) == (pc.PeakOrigin.CACHED, 3e10)      # identical runs, identical peak
    assert len(source.calls) == 1

    half = pc.resolve_peak(device=CPU, dtype=torch.float16, source=CountingSource(4e9), cache=cache)
    assert (half.origin, half.flops) == (pc.PeakOrigin.MEASURED, 4e9)        # fp16 has its own entry
    keys = sorted(json.loads((tmp_path / "peak.json").read_text()))
    assert len(keys) == 2 and any("|float16|" in k for k in keys) and any("|float32|" in k for k in keys)
    name = pc.device_name(CPU)
    assert all(k.startswith(name + "|") and f"torch {torch.__version__}" in k and
               f"threads={torch.get_num_threads()}" in k for k in keys)


def test_given_and_spec_peaks_are_used_as_is_and_never_cached(tmp_path) -> None:
    cache = pc.PeakCache(tmp_path / "peak.json")
    source = CountingSource(1.0)
    given = pc.resolve_peak(device=CPU, dtype=torch.float32, given_tflops=0.5, source=source, cache=cache)
    assert (given.origin, given.flops, source.calls) == (pc.PeakOrigin.GIVEN, 0.5e12, [])
    spec = pc.resolve_peak(device=CPU, dtype=torch.bfloat16, source=CountingSource(989e12, "spec"), cache=cache)
    assert (spec.origin, spec.flops, spec.cache_key) == (pc.PeakOrigin.SPEC, 989e12, "")
    assert not (tmp_path / "peak.json").exists()


def test_cache_dir_follows_the_environment_and_survives_a_corrupt_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(pc.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert pc.PeakCache().path == tmp_path / "elsewhere" / pc.CACHE_FILE
    monkeypatch.delenv(pc.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pc.cache_dir() == tmp_path / "xdg" / "shardwise"

    path = tmp_path / "peak.json"
    path.write_text("{not json")
    peak = pc.resolve_peak(device=CPU, dtype=torch.float32, source=CountingSource(2e10), cache=pc.PeakCache(path))
    assert peak.origin is pc.PeakOrigin.MEASURED                          # unreadable cache = empty cache
    assert json.loads(path.read_text())[peak.cache_key]["flops"] == 2e10  # and the write repaired it


def test_measured_peak_is_the_faster_layout_in_the_training_dtype(monkeypatch) -> None:
    seen = []

    def fake(*, dtype, device, size, seconds, transposed):
        seen.append((dtype, transposed))
        assert size == 1024
        return 4e9 if transposed else 4e8      # CPU fp16: a @ b.T has a fast kernel, a @ b a generic one

    monkeypatch.setattr(pc, "measure_matmul_peak_flops", fake)
    assert pc.measured_peak(CPU, torch.float16) == (4e9, "measured")
    assert sorted(seen) == [(torch.float16, False), (torch.float16, True)]


def test_guard_keeps_mfu_at_most_one_says_so_once_and_drops_the_cache(tmp_path) -> None:
    cache = pc.PeakCache(tmp_path / "peak.json")
    rank_peak = pc.resolve_peak(device=CPU, dtype=torch.float16, source=CountingSource(1e9), cache=cache)
    lines: list[str] = []
    guard = pc.PeakGuard(2e9, rank_peak, cache=cache, warn=lines.append)    # two ranks
    assert guard.bound(1.5e9, step=1) == 2e9 and not guard.corrected
    assert guard.bound(6e9, step=2) == 6e9 and guard.corrected               # achieved 3x the "peak"
    assert guard.bound(5e9, step=3) == 6e9
    assert len(lines) == 1 and "step 2" in lines[0] and "too low" in lines[0] and "next run measures" in lines[0]
    assert cache.get(rank_peak.cache_key) is None
    m = StepMetrics.build(step=2, loss=1.0, lr=0.1, tokens=600, step_time_s=1.0, elapsed_s=1.0,
                          flops_per_token=1e7, peak_flops=guard.bound(6e9, step=2), rss_bytes=1)
    assert m.mfu == pytest.approx(1.0)

    given = pc.PeakFlops(1e9, pc.PeakOrigin.GIVEN, "cpu", torch.float32)
    said: list[str] = []
    pc.PeakGuard(1e9, given, cache=cache, warn=said.append).bound(2e9, step=5)
    assert "--peak-tflops" in said[0] and "cached" not in said[0]


def test_ranks_that_measure_agree_on_one_figure_the_job_divides_by_and_caches(tmp_path) -> None:
    reader = pc.PeakCache(tmp_path / "peak.json", writer=False)
    # Three ranks measuring at once get three figures; a rank given --peak-tflops keeps its own.
    peaks = [pc.resolve_peak(device=CPU, dtype=torch.float32, source=CountingSource(f), cache=reader)
             for f in (1e9, 2e9, 6e9)] + [pc.PeakFlops(5e9, pc.PeakOrigin.GIVEN, "cpu", torch.float32)]
    assert reader.get(peaks[0].cache_key) is None          # not a writer: nothing cached before they agree
    agreed = pc.agree_measured(peaks)
    assert [p.flops for p in agreed] == [3e9, 3e9, 3e9, 5e9]
    assert sum(p.flops for p in agreed) == sum(p.flops for p in peaks)     # the job's peak is unchanged
    assert agreed[0].describe().endswith("(measured), the mean of 3 ranks measuring at once")
    assert agreed[0].describe().startswith("0.003 TFLOP/s per rank")      # the figure printed is the one used
    assert agreed[3] == peaks[3]


def test_progress_line_shows_gradient_norm_loss_scale_and_skips() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=300)
    common = dict(lr=1e-3, tokens=64, step_time_s=0.1, elapsed_s=0.1, flops_per_token=1.0, peak_flops=1e12,
                  rss_bytes=1)
    with TrainProgress(10, enabled=True, steps_per_print=10, console=console) as progress:
        progress.update(StepMetrics.build(step=1, loss=5.0, grad_norm=1.83, loss_scale=65536.0, **common))
        progress.update(StepMetrics.build(step=2, loss=5.0, grad_norm=float("inf"), loss_scale=32768.0,
                                          skipped_steps=1, skipped=True, **common))
        progress.update(StepMetrics.build(step=3, loss=4.9, grad_norm=1.5, loss_scale=32768.0, skipped_steps=1,
                                          **common))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2                 # step 1, and step 2 because it skipped; step 3 is not due
    assert "gnorm 1.83 | scale 65536 | skipped 0 |" in lines[0]
    assert lines[1].startswith("step 2/10") and "gnorm inf | scale 32768 | skipped 1 (this step)" in lines[1]


def test_one_progress_line_per_interval_with_the_interval_s_throughput() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=300)
    times = [0.5, 0.1, 0.2, 0.3, 0.4, 0.1, 0.2]          # step 1 pays for warm-up
    with TrainProgress(7, enabled=True, steps_per_print=3, console=console) as progress:
        for step, t in enumerate(times, start=1):
            progress.update(StepMetrics.build(step=step, loss=1.0, lr=1e-3, tokens=100, step_time_s=t, elapsed_s=1.0,
                                              flops_per_token=1e6, peak_flops=1e9, rss_bytes=1))
    lines = buf.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1/7", "step 3/7", "step 6/7", "step 7/7"]
    # each line's tokens/s, MFU and s/step are those of the steps since the previous line
    assert "| 200.0 tok/s | MFU 20.0% | 0.500 s/step (step 1) |" in lines[0]
    assert "| 666.7 tok/s | MFU 66.7% | 0.150 s/step (steps 2-3) |" in lines[1]
    assert "| 375.0 tok/s | MFU 37.5% | 0.267 s/step (steps 4-6) |" in lines[2]
    assert "| 500.0 tok/s | MFU 50.0% | 0.200 s/step (step 7) |" in lines[3]


def test_node_log_names_the_node_its_ranks_and_appends(tmp_path, monkeypatch, capsys) -> None:
    from shardwise.telemetry.node_log import NodeLog, RankPlace, _spans

    assert _spans([5, 0, 1, 2]) == "0-2, 5" and _spans([3]) == "3"
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    me = RankPlace.from_env(2)
    assert (me.node_rank, me.nnodes, me.local_rank) == (1, 2, 0)
    places = [RankPlace(r, r // 2, 2, r % 2, "h") for r in range(4)]
    for attempt in range(2):                              # a resumed run appends to the node's log
        log = NodeLog(tmp_path, me, places, steps_per_print=2)
        for step, t in ((1, 0.5), (2, 0.2), (3, 0.4)):
            log.step(step, 3, 4.0 - step / 10, t)
        log.finish([{"peak_rss": 100 * (r + 1)} for r in range(4)])
    row = json.loads((tmp_path / "node1.json").read_text())
    assert (row["global_ranks"], row["local_ranks"], row["steps"], row["peak_rss_bytes"]) == ([2, 3], [0, 1], 3,
                                                                                               [300, 400])
    assert row["final_loss"] == pytest.approx(3.7) and row["mean_step_time_s"] == pytest.approx(0.3)
    text = (tmp_path / "node1.log").read_text()
    assert text.count("node 1 of 2 on ") == 2 and text.count("step 2/3") == 2 and "step 1/3" in text
    assert "node 1 (" in capsys.readouterr().out
    other = NodeLog(tmp_path / "x", RankPlace(3, 1, 2, 1, "h"), places, steps_per_print=1)   # local rank 1
    other.finish([{}] * 4)
    assert not (tmp_path / "x").exists()
