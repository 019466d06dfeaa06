"""DeepSpeed's monitoring blocks, piece by piece: config, event writers read back, timers line, comms logger
arithmetic, flops profiler counts against the GPT's analytic FLOPs."""

from __future__ import annotations

import csv
import importlib
import re
import sys

import pytest
import torch

from shardwise.comm.ledger import CommLedger
from shardwise.config import ConfigError, load_config
from shardwise.config.monitoring import (
    CommsLoggerConfig, EventFilesConfig, FlopsProfilerConfig, MonitoringConfig, WandbConfig,
)
from shardwise.errors import UserError
from shardwise.telemetry.comms_logger import CommsLogger, bus_factor
from shardwise.telemetry.events import CSVWriter, EventWriters, csv_file_name, require_package
from shardwise.telemetry.flops_profiler import FlopsProfiler
from shardwise.telemetry.timers import PhaseTimers, breakdown_line
from shardwise.testing import gpt_forward_flops, tiny_gpt

BASE = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


# -- config -------------------------------------------------------------------------------------------
def test_monitor_blocks_are_accepted_with_deepspeeds_defaults() -> None:
    monitor_config = pytest.importorskip("deepspeed.monitor.config")
    cfg = load_config({**BASE, "tensorboard": {}, "csv_monitor": {"enabled": False}, "wandb": {}}, dp_size=1)
    ds = monitor_config.get_monitor_config({})
    for ours, theirs in ((cfg.monitors.tensorboard, ds.tensorboard), (cfg.monitors.csv_monitor, ds.csv_monitor),
                         (cfg.monitors.wandb, ds.wandb)):
        for name in type(ours).model_fields:
            assert getattr(ours, name) == getattr(theirs, name), name
    comm_config = importlib.import_module("deepspeed.comm.config").CommsLoggerConfig()
    for name in ("enabled", "verbose", "prof_all", "debug"):
        assert getattr(cfg.monitors.comms_logger, name) == getattr(comm_config, name), name
    profiling = importlib.import_module("deepspeed.profiling.config").DeepSpeedFlopsProfilerConfig({})
    for name in type(cfg.monitors.flops_profiler).model_fields:
        assert getattr(cfg.monitors.flops_profiler, name) == getattr(profiling, name), name


def test_monitor_blocks_resolve_and_typos_name_the_key() -> None:
    cfg = load_config({**BASE, "steps_per_print": 5, "wall_clock_breakdown": True,
                       "tensorboard": {"enabled": True, "output_path": "runs", "job_name": "a"},
                       "comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]},
                       "flops_profiler": {"enabled": True, "profile_step": 3, "module_depth": 2}}, dp_size=1)
    m = cfg.monitors
    assert (m.steps_per_print, m.wall_clock_breakdown, m.writes_events) == (5, True, True)
    assert m.tensorboard.log_dir == "runs/a" and m.flops_profiler.profile_step == 3
    assert m.comms_logger.logs("all_reduce") and not m.comms_logger.logs("all_gather")
    with pytest.raises(ConfigError) as err:
        load_config({**BASE, "tensorboard": {"enable": True}}, dp_size=1)
    assert err.value.key == "tensorboard.enable" and 'did you mean "enabled"?' in str(err.value)
    # each pipeline stage profiles its own modules
    assert load_config({**BASE, "flops_profiler": {"enabled": True}, "pipeline": {"stages": 2}},
                       dp_size=1).monitors.flops_profiler.enabled


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)       # import wandb now raises ImportError
    with pytest.raises(UserError) as err:
        require_package("wandb", "wandb.enabled")
    text = str(err.value)
    assert "\n" not in text and '"wandb.enabled"' in text and "shardwise[monitors]" in text
    # Every rank stops, not only the rank that would write.
    with pytest.raises(UserError, match="shardwise\\[monitors\\]"):
        EventWriters.build(MonitoringConfig(wandb=WandbConfig(enabled=True)), global_rank=1)


# -- event writers --------------------------------------------------------------------------------------
def test_csv_monitor_writes_one_file_per_tag_with_deepspeeds_names(tmp_path) -> None:
    section = EventFilesConfig(enabled=True, output_path=str(tmp_path), job_name="job")
    writer = CSVWriter(section)
    writer.write([("Train/Samples/lr", 0.5, 8), ("Train/Samples/train_loss", 3.25, 8)])
    writer.write([("Train/Samples/lr", 0.25, 16)])
    assert csv_file_name("Train/Samples/my tag") == "Train_Samples_my_tag.csv"
    with open(tmp_path / "job" / "Train_Samples_lr.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "lr"], ["8", "0.5"], ["16", "0.25"]]
    CSVWriter(section).write([("Train/Samples/lr", 0.125, 24)])     # a second writer appends, no new header
    with open(tmp_path / "job" / "Train_Samples_lr.csv", newline="") as f:
        assert [row[0] for row in csv.reader(f)] == ["step", "8", "16", "24"]


def test_tensorboard_events_read_back(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    section = MonitoringConfig(tensorboard=EventFilesConfig(enabled=True, output_path=str(tmp_path), job_name="j"))
    writers = EventWriters.build(section, global_rank=0)
    writers.write([("Train/Samples/lr", 0.5, 4), ("Train/Samples/train_loss", 2.0, 4)])
    writers.write([("Train/Samples/lr", 0.25, 8), ("Train/Samples/train_loss", 1.5, 8)])
    writers.close()
    acc = EventAccumulator(str(tmp_path / "j"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"Train/Samples/lr", "Train/Samples/train_loss"}
    assert [(e.step, e.value) for e in acc.Scalars("Train/Samples/lr")] == [(4, 0.5), (8, 0.25)]
    assert not EventWriters.build(section, global_rank=1).enabled     # other ranks write nothing


# -- timers -----------------------------------------------------------------------------------------------
def test_timers_line_is_the_mean_per_step_and_resets() -> None:
    timers = PhaseTimers(enabled=True, device=torch.device("cpu"))
    for _ in range(2):
        with timers.timed("fwd"):
            pass
        with timers.timed("step"):
            pass
    total = timers.total_ms("fwd")
    line = breakdown_line(timers, steps=2)
    assert line == f"time (ms) | fwd: {total / 2:.2f} | step: {timers.total_ms('step') / 2:.2f}"
    assert set(timers.end_step()) == {"fwd", "step"} and timers.end_step() == {}
    timers.reset()
    assert breakdown_line(timers, steps=1) is None
    off = PhaseTimers(enabled=False, device=torch.device("cpu"))
    with off.timed("fwd"):
        pass
    assert off.total_ms("fwd") is None


# -- comms logger --------------------------------------------------------------------------------------
def _finish(ledger: CommLedger, op: str, group: str, size: int, nbytes: int) -> None:
    ledger.finish(ledger.start(op, group), op=op, group=group, group_size=size, nbytes=nbytes, dtype="float32")


def test_comms_logger_rows_bandwidth_and_filters() -> None:
    ledger = CommLedger()
    printed: list[str] = []
    logger = CommsLogger(CommsLoggerConfig(enabled=True, debug=True), ledger, global_rank=0, out=printed.append)
    _finish(ledger, "all_reduce", "dp", 4, 4096)
    _finish(ledger, "all_reduce", "dp", 4, 4096)
    _finish(ledger, "all_reduce", "dp:metrics", 4, 8)
    _finish(ledger, "all_gather", "dp", 4, 1024)
    rows = {(r.op, r.group, r.msg_bytes): r for r in logger.rows()}
    big = rows[("all_reduce", "dp", 4096)]
    assert (big.count, big.total_bytes) == (2, 8192)
    assert big.algbw_gbps == pytest.approx(8192 * 8 / big.seconds / 1e9)
    assert big.busbw_gbps == pytest.approx(big.algbw_gbps * 2 * 3 / 4)
    assert bus_factor("all_gather", 4) == 0.75 and bus_factor("broadcast", 4) == 1.0
    logger.log_summary(steps=3)
    assert printed[0] == "communication over the last 3 step(s):"
    table = "\n".join(printed)
    assert re.search(r"all_reduce \| dp\s+4.00 KB\s+2\s", table) and "all_reduce | dp:metrics" in table
    assert logger.rows() == []                                   # the next summary starts over

    quiet: list[str] = []
    only = CommsLogger(CommsLoggerConfig(enabled=True, prof_all=False, prof_ops=("all_gather",), verbose=True),
                       ledger, global_rank=0, out=quiet.append)
    _finish(ledger, "all_reduce", "dp", 4, 4096)
    _finish(ledger, "all_gather", "dp", 4, 1024)
    assert [(r.op, r.group, r.count) for r in only.rows()] == [("all_gather", None, 1)]
    assert len(quiet) == 1 and quiet[0].startswith("comm op: all_gather | time (ms): ")
    silent: list[str] = []
    CommsLogger(CommsLoggerConfig(enabled=True, verbose=True), ledger, global_rank=1, out=silent.append)
    _finish(ledger, "all_reduce", "dp", 4, 4096)
    assert silent == []


# -- flops profiler --------------------------------------------------------------------------------------
def test_flops_profile_of_the_gpt_matches_its_analytic_count() -> None:
    model = tiny_gpt(n_layer=2, d_model=32, seq_len=16)
    rows, seq = 3, 16
    profiler = FlopsProfiler(FlopsProfilerConfig(enabled=True, profile_step=0, module_depth=3, detailed=True),
                             model, device=torch.device("cpu"))
    assert profiler.wants(0) and not profiler.wants(1)
    x = torch.randint(0, 256, (rows, seq))
    with profiler.profiling():
        model(x, x)
    assert not profiler.wants(0)                              # once
    exact, gap = gpt_forward_flops(model, rows * seq)
    top = profiler.profile[0]
    assert top.flops == exact
    analytic = model.flops_per_token() * rows * seq // 3
    assert abs(top.flops - analytic) <= gap and gap / analytic < 0.05
    assert top.params == sum(p.numel() for p in model.parameters()) and top.latency_ms > 0
    by_name = {p.name: p for p in profiler.profile}
    assert by_name["blocks"].flops == by_name["blocks.0"].flops + by_name["blocks.1"].flops   # a ModuleList sums
    d, s, b = 32, seq, rows
    assert by_name["blocks.0.attn.q_proj"].flops == 2 * b * s * d * d
    assert by_name["head.lm_head"].flops == 2 * b * s * d * 256
    lines = profiler.report_lines(step=0, micro_batch=rows, world_size=1, dp_size=1, mp_size=1, bwd_ms=2.0,
                                  step_ms=1.0)
    text = "\n".join(lines)
    assert f"({exact})" in text and "bwd latency:" in text and "iter latency" in text
    assert "q_proj" not in text                              # module_depth 3 stops above blocks.0.attn.q_proj (depth 4)
    assert re.search(r"\n\s+attn\s+Attention\s+\d+\s+" + str(by_name["blocks.0.attn"].flops), text)


# -- wandb, offline ---------------------------------------------------------------------------------------
def _wandb_values(run_file, tag: str) -> set[float]:
    """The values logged under `tag` in an offline run's .wandb file: each history item stores its key then,
    as protobuf field 16 (bytes 0x82 0x01), a length and the value as JSON."""
    data = run_file.read_bytes()
    key = tag.encode()
    values = set()
    for m in re.finditer(re.escape(key) + rb"\x82\x01", data):
        length = data[m.end()]
        values.add(float(data[m.end() + 1:m.end() + 1 + length]))
    return values


def test_wandb_offline_writes_its_run_directory(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    section = MonitoringConfig(wandb=WandbConfig(enabled=True, project="shardwise-test", group="g"))
    writers = EventWriters.build(section, global_rank=0)
    run = writers.writers[0].run
    assert (run.project, run.group) == ("shardwise-test", "g")
    writers.write([("Train/Samples/lr", 0.5, 4), ("Train/Samples/train_loss", 2.25, 4)])
    writers.write([("Train/Samples/lr", 0.25, 8), ("Train/Samples/train_loss", 1.75, 8)])
    writers.close()
    import wandb
    wandb.teardown()          # wait for W&B's service process to write everything out before reading the file
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    assert _wandb_values(run_file, "Train/Samples/lr") == {0.5, 0.25}
    assert _wandb_values(run_file, "Train/Samples/train_loss") == {2.25, 1.75}


@pytest.mark.parametrize("name", ["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"])
def test_attention_is_priced_on_every_backend_and_halved_when_causal(name: str) -> None:
    from shardwise.telemetry.flops_profiler import _attention_formula
    packet = getattr(torch.ops.aten, name)
    b, h, s, d = 2, 4, 16, 8
    q = k = v = torch.empty(b, h, s, d, device="meta")
    names = [a.name for a in packet.default._schema.arguments if not a.kwarg_only][3:]
    formula = _attention_formula(packet)
    full = 2 * b * h * s * s * (d + d)                # QK^T and the mix with V
    for causal in (False, True):
        # The op's positional arguments after q, k, v as a caller passes them (placeholders but is_causal).
        args = [causal if n == "is_causal" else None for n in names]
        assert formula(q, k, v, *args) == (full // 2 if causal else full)
    assert formula(q, k, v, is_causal=True) == full // 2
    assert formula(q, k, v) == full                    # is_causal left at its default
