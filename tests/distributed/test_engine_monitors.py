"""DeepSpeed's monitors on 2 ranks: TensorBoard and CSV events read back with the values the engine had, written
by global rank 0 only; steps_per_print, wall_clock_breakdown, comms_logger and flops_profiler output captured
and checked against the engine, the communication ledger and the GPT's analytic FLOPs."""

from __future__ import annotations

import csv
import io
import re
from collections import Counter
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from shardwise.testing import gpt_forward_flops, micro_steps, run_distributed, tiny_gpt, token_batches

SEQ = 16
MICRO = 2
STEPS = 4          # steps 1-2 by engine.train_batch, 3-4 by engine(batch) / backward / step
TIMER_TAGS = ("forward", "backward", "backward_inner", "backward_allreduce", "step")


def _config(out: str) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": MICRO,    # 2 ranks: 2 micro-batches each
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                         "warmup_num_steps": 10}},
            "fp16": {"enabled": True, "initial_scale_power": 12},
            "zero_optimization": {"stage": 0, "reduce_bucket_size": 5000},
            "steps_per_print": 2, "wall_clock_breakdown": True,
            "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
            "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"},
            "comms_logger": {"enabled": True},
            "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 2, "top_modules": 2}}


def _train(out: str) -> dict:
    import shardwise
    model = tiny_gpt(seq_len=SEQ)
    buf = io.StringIO()
    seen: dict = {"loss": [], "samples": [], "lr": [], "scale": [], "skipped": [], "windows": []}
    with redirect_stdout(buf):
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=_config(out))
        # Count the ledger's records ourselves and compare with what each comms summary holds.
        counted: Counter = Counter()
        engine.ledger.listeners.append(lambda r: counted.update([r.op]))
        take = engine.monitor.comms.take

        def take_and_compare():
            rows = take()
            summed: Counter = Counter()
            for row in rows:
                summed[row.op] += row.count
            seen["windows"].append((dict(summed), dict(counted)))
            counted.clear()
            return rows

        engine.monitor.comms.take = take_and_compare
        for step in range(STEPS):
            batch = token_batches(1, 8, SEQ + 1, seed=100 + step)[0]
            (micro,) = micro_steps([batch], dp_size=2, dp_rank=engine.dp_rank, grad_accum=2)
            if step < 2:
                seen["loss"].append(float(engine.train_batch(iter(micro))))
            else:
                losses = []
                for pair in micro:
                    loss = engine(pair)
                    engine.backward(loss)
                    engine.step()
                    losses.append(float(loss))
                seen["loss"].append(sum(losses) / len(losses))    # this rank's micro-batch mean
            seen["samples"].append(engine.global_samples)
            seen["lr"].append(engine.get_lr())
            seen["scale"].append(engine.current_loss_scale)
            seen["skipped"].append(engine.skipped_steps)
        profile = engine.monitor.flops.profile if engine.monitor.flops is not None else None
        seen["flops"] = profile[0].flops if profile else None
        seen["writers"] = len(engine.monitor.events.writers)
        engine.close()
    seen["stdout"] = buf.getvalue()
    return seen


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("monitors")
    return out, run_distributed(_train, 2, args=(str(out),))


def _csv(path: Path) -> list[tuple[int, float]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return [(int(x), float(v)) for x, v in rows[1:]]


def test_tensorboard_and_csv_hold_the_engines_values_written_by_rank0_only(run) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, (r0, r1) = run
    assert r0["writers"] == 2 and r1["writers"] == 0
    assert len(list((out / "tb").iterdir())) == 1                 # one events file: rank 0's
    expected = {"train_loss": r0["loss"], "lr": [lr[0] for lr in r0["lr"]], "loss_scale": r0["scale"]}
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = {f"Train/Samples/{name}" for name in list(expected) + [f"elapsed_time_ms_{t}" for t in TIMER_TAGS]}
    assert set(acc.Tags()["scalars"]) == tags
    assert sorted(p.name for p in (out / "csv").iterdir()) == sorted(t.replace("/", "_") + ".csv" for t in tags)
    for name, values in expected.items():
        board = [(e.step, e.value) for e in acc.Scalars(f"Train/Samples/{name}")]
        assert [x for x, _ in board] == r0["samples"] == [8, 16, 24, 32]
        assert [v for _, v in board] == pytest.approx(values, rel=1e-6)        # TensorBoard keeps float32
        assert _csv(out / "csv" / f"Train_Samples_{name}.csv") == list(zip(r0["samples"], values))
    # Steps 1-2 log the loss the ranks agreed on; steps 3-4 rank 0's own micro-batch mean.
    assert r0["loss"][:2] == r1["loss"][:2] and r0["loss"][2:] != r1["loss"][2:]
    with open(out / "csv" / "Train_Samples_elapsed_time_ms_forward.csv", newline="") as f:
        assert next(csv.reader(f)) == ["step", "elapsed_time_ms_forward"]


def test_printed_lines_match_the_engine(run) -> None:
    out, (r0, r1) = run
    assert r1["stdout"] == ""                                     # rank 0 prints, nobody else
    text = r0["stdout"]
    steps = re.findall(r"^\[Rank 0\] step=(\d+), skipped=(\d+), lr=(.*), mom=(.*)$", text, re.M)
    assert steps == [(str(s), str(r0["skipped"][s - 1]), repr(r0["lr"][s - 1]), "[(0.9, 0.999)]") for s in (2, 4)]
    assert f"steps: 2 loss: {r0['loss'][1]:0.4f} iter time (s): " in text
    # The timers line is each timer's mean per step over the 2 steps since the last print: the monitor's
    # per-step figures averaged.
    lines = re.findall(r"^\[Rank 0\] time \(ms\) \| (.*)$", text, re.M)
    assert len(lines) == 2
    csv_dir = out / "csv"
    for window, line in enumerate(lines):
        printed = dict(part.split(": ") for part in line.split(" | "))
        assert list(printed) == ["fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"]
        for key, tag in zip(printed, TIMER_TAGS):
            per_step = [v for _, v in _csv(csv_dir / f"Train_Samples_elapsed_time_ms_{tag}.csv")]
            mean = sum(per_step[2 * window:2 * window + 2]) / 2
            assert abs(float(printed[key]) - mean) <= 0.005 + 1e-9, (key, printed[key], mean)


def test_comms_summary_counts_what_the_ledger_recorded(run) -> None:
    _, (r0, r1) = run
    for rank in (r0, r1):
        assert len(rank["windows"]) == 2                           # printed at steps 2 and 4
        for summed, counted in rank["windows"]:
            assert summed == counted and summed["all_reduce"] > 0
    text = r0["stdout"]
    assert text.count("communication over the last 2 step(s):") == 2
    assert re.search(r"^all_reduce\s+\d+(\.\d+)? [KMG]?B\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", text, re.M)


def test_flops_profile_at_profile_step(run) -> None:
    _, (r0, r1) = run
    exact, gap = gpt_forward_flops(tiny_gpt(seq_len=SEQ), MICRO * SEQ)
    assert r0["flops"] == exact and r1["flops"] is None
    analytic = tiny_gpt(seq_len=SEQ).flops_per_token() * MICRO * SEQ // 3
    assert abs(r0["flops"] - analytic) <= gap
    text = r0["stdout"]
    assert "profile of the first micro-batch of step 1" in text
    assert re.search(rf"^fwd flops per GPU:\s+\S+ \S* ?\({exact}\)$", text, re.M)
    assert re.search(r"^world size:\s+2$", text, re.M) and re.search(r"^data parallel size:\s+2$", text, re.M)
    assert re.search(r"^depth 1: .*; ", text, re.M)               # top_modules 2


# -- under ZeRO-3, tensor parallelism and a pipeline --------------------------------------------------------
def _train_layout(extra: dict, out: str) -> dict:
    import shardwise
    model = tiny_gpt(seq_len=SEQ)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 1,
           "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"}, **extra}
    buf = io.StringIO()
    losses = []
    with redirect_stdout(buf):
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        for step in range(2):
            batch = token_batches(1, 8, SEQ + 1, seed=100 + step)[0]
            (micro,) = micro_steps([batch], dp_size=engine.dp_size, dp_rank=engine.dp_rank,
                                   grad_accum=engine.gradient_accumulation_steps())
            losses.append(float(engine.train_batch(iter(micro))))
        flops = engine.monitor.flops.profile if engine.monitor.flops is not None else None
        engine.close()
    return {"stdout": buf.getvalue(), "losses": losses, "flops": flops[0].flops if flops else None}


@pytest.mark.parametrize("layout, share", [("zero3", 1), ("tp", 2)])
def test_flops_profile_counts_this_ranks_share(tmp_path, layout: str, share: int) -> None:
    extra = {"zero3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
             "tp": {"tensor_parallel": {"size": 2}}}[layout]
    extra["flops_profiler"] = {"enabled": True, "profile_step": 0, "detailed": False}
    r0, r1 = run_distributed(_train_layout, 2, args=(extra, str(tmp_path)))
    exact, _ = gpt_forward_flops(tiny_gpt(seq_len=SEQ), MICRO * SEQ)
    assert r0["flops"] == exact // share and r1["flops"] is None    # TP: every matmul and head split in two
    assert f"({exact // share})" in r0["stdout"] and r1["stdout"] == ""


def test_pipeline_logs_the_agreed_loss_and_profiles_each_stage(tmp_path) -> None:
    extra = {"pipeline": {"stages": 2}, "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": True}}
    r0, r1 = run_distributed(_train_layout, 2, args=(extra, str(tmp_path)))
    assert r0["losses"] == r1["losses"]
    # each stage counted its own layers on its first micro-batch: together, the whole model's forward
    exact, _ = gpt_forward_flops(tiny_gpt(seq_len=SEQ), MICRO * SEQ)
    assert r0["flops"] > 0 and r1["flops"] > 0 and r0["flops"] + r1["flops"] == exact
    for stage, res in enumerate((r0, r1)):
        text = res["stdout"]
        assert "profile of the first micro-batch of step 1 (pipeline stage" in text
        assert re.search(rf"^fwd flops per GPU \(stage {stage} of 2\):\s+\S+ \S* ?\({res['flops']}\)$", text, re.M)
    # rows under the full model's names: the embedding on stage 0, the head on stage 1
    for name, holder, other in (("embed", r0, r1), ("head", r1, r0)):
        assert re.search(rf"^\s+{name}\s", holder["stdout"], re.M) and not re.search(rf"^\s+{name}\s",
                                                                                     other["stdout"], re.M)
    assert _csv(tmp_path / "csv" / "Train_Samples_train_loss.csv") == list(zip([8, 16], r0["losses"]))
    for step, loss in enumerate(r0["losses"], start=1):
        assert f"[Rank 0] step={step}, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]" in r0["stdout"]
        assert f"steps: {step} loss: {loss:0.4f} iter time (s): " in r0["stdout"]
