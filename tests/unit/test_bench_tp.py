"""The tensor-parallel benchmark: its summary arithmetic, its round order and loss check, its argument errors,
and one tiny real run on 2 ranks through torch's elastic launcher (the path `shardwise bench tp --nproc 2`
takes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import tp as bench
from shardwise.cli.main import main as cli_main
from shardwise.models import gpt_config, gpt_num_params


def test_summary_uses_medians_and_shardwise_over_torch_ratio() -> None:
    times = {"shardwise": [[0.010, 0.012, 0.011], [0.020, 0.011, 0.013]],     # median of all six: 0.0115
             "torch": [[0.023, 0.023, 0.500], [0.022, 0.024, 0.021]]}         # median: 0.023
    memory = {"shardwise": {"params": 40, "grads": 40, "optimizer": 80, "activations": 7},
              "torch": {"params": 40, "grads": 48, "optimizer": 80, "activations": 9}}
    rows = {r.trainer: r for r in bench.summarize(times, memory, tokens_per_step=1000)}
    assert rows["shardwise"].median_ms == pytest.approx(11.5)
    assert (rows["shardwise"].round_min_ms, rows["shardwise"].round_max_ms) == pytest.approx((11.0, 13.0))
    assert rows["shardwise"].shardwise_ratio == pytest.approx(1.0)
    assert rows["shardwise"].paired_ratio == pytest.approx(1.0)
    assert rows["torch"].median_ms == pytest.approx(23.0)
    assert rows["torch"].shardwise_ratio == pytest.approx(0.5)                # shardwise twice as fast
    # per round: 0.011 / 0.023 and 0.013 / 0.022; the median of two is their mean
    assert rows["torch"].paired_ratio == pytest.approx((0.011 / 0.023 + 0.013 / 0.022) / 2)
    assert rows["torch"].tokens_per_s == pytest.approx(1000 / 0.023)
    assert rows["torch"].model_states_bytes == 168
    assert rows["torch"].activation_bytes == 9


def test_rounds_alternate_which_goes_first() -> None:
    assert [bench.round_order(r) for r in range(3)] == [
        [bench.Impl.SHARDWISE, bench.Impl.TORCH], [bench.Impl.TORCH, bench.Impl.SHARDWISE],
        [bench.Impl.SHARDWISE, bench.Impl.TORCH]]


def test_warmup_check_compares_losses_and_gradients_on_one_scale() -> None:
    f64 = dict(dtype=torch.float64)
    theirs = {"w": torch.tensor([1.0, -2.0], **f64), "tiny": torch.tensor([1e-9, 0.0], **f64)}
    # "tiny" is 200% off, but by 2e-9 against the largest gradient 2: rounding noise, not a wrong gradient
    close = {"w": torch.tensor([1.0, -2.0 + 1e-6], **f64), "tiny": torch.tensor([3e-9, 0.0], **f64)}
    loss_rel, grad_rel, message = bench.warmup_mismatch([(1.0 + 1e-6, 1.0), (2.0, 2.0)], (close, theirs), rtol=1e-5)
    assert message == "" and loss_rel == pytest.approx(1e-6) and grad_rel == pytest.approx(0.5e-6, rel=1e-3)
    far = dict(close, w=torch.tensor([1.0, -2.1], **f64))
    _, grad_rel, message = bench.warmup_mismatch([(1.0, 1.0)], (far, theirs), rtol=1e-5)
    assert grad_rel == pytest.approx(0.05, rel=1e-4)
    assert "step 1 gradient of w" in message and "loss" not in message
    # a later step's loss: the update differed even though the first forward agreed
    loss_rel, _, message = bench.warmup_mismatch([(1.0, 1.0), (1.1, 1.0), (3.0, 2.0)], (close, theirs), rtol=1e-5)
    assert loss_rel == pytest.approx(0.5)
    assert "step 2 loss 1.1 vs torch 1.0" in message and "> --rtol 1e-05" in message
    _, _, message = bench.warmup_mismatch([(1.0, 1.0)], ({"w": torch.zeros(3)}, {"w": torch.zeros(2)}), rtol=1e-5)
    assert "w: shardwise holds a (3,) shard, torch (2,)" in message


@pytest.mark.parametrize("nproc,argv,fragment", [
    (1, [], "--nproc must be >= 2"),
    (2, ["--d-model", "100", "--heads", "8"], "must be a multiple of --heads"),
    (4, ["--heads", "6", "--d-model", "192"], "--heads = 6 must be a multiple of --nproc = 4"),
    (4, ["--vocab", "258"], "--vocab = 258 must be a multiple of --nproc = 4"),
    (4, ["--seq", "30", "--sequence-parallel"], "--seq = 30 must be a multiple of --nproc = 4"),
])
def test_bad_shapes_are_rejected_before_launch(nproc: int, argv: list[str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("+", r"\+")):
        bench.launch(nproc, argv)


@pytest.mark.parametrize("argv,fragment", [(["--rounds", "0"], "must be an integer >= 1"),
                                           (["--rtol", "0"], "must be > 0"),
                                           (["--d-model", "x"], "argument --d-model")])
def test_bad_option_exits_2(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.launch(2, argv)
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_defaults_parse_and_split_over_two_and_four_ranks() -> None:
    args = bench.build_parser().parse_args([])
    assert (args.d_model, args.heads, args.seq, args.rtol) == (256, 8, 128, 1e-5)
    for nproc in (2, 4):
        bench.check_args(args, nproc)


def test_main_outside_the_launcher_says_how_to_run(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert bench.main([]) == 2
    assert "torch.distributed.run" in capsys.readouterr().err


def test_cli_lists_tp_and_rejects_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "tp", "--help"]) == 0
    assert "--sequence-parallel" in capsys.readouterr().out
    assert cli_main(["bench", "tp", "--nproc", "1"]) == 2
    assert "--nproc must be >= 2" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [(), ("--sequence-parallel",)], ids=["tp", "tp_sp"])
def test_tiny_run_on_two_ranks(extra: tuple[str, ...], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tp.json"
    code = bench.launch(2, ["--d-model", "32", "--heads", "4", "--layers", "2", "--seq", "16", "--vocab", "64",
                            "--micro-batch", "2", "--rounds", "2", "--steps", "1", "--warmup", "2",
                            "--json", str(out), *extra])
    assert code == 0, capfd.readouterr().err[-3000:]
    assert "shardwise / this" in capfd.readouterr().out       # rank 0 printed the table
    report = json.loads(out.read_text())
    assert report["config"]["world_size"] == 2
    assert report["config"]["shardwise_config"]["tensor_parallel"]["size"] == 2
    check = report["loss_check"]
    # Both trained the same model on the same batches: every warm-up loss (the forward, then the forward after
    # each AdamW update) and the first step's gradients agree.
    assert check["passed"] and check["loss_rel_diff"] <= 1e-5 and check["grad_rel_diff"] <= 1e-5
    losses = check["warmup_losses"]
    assert len(losses) == 2 and losses[0]["shardwise"] != losses[1]["shardwise"]    # two batches, not one
    assert all(p["shardwise"] == pytest.approx(p["torch"], rel=1e-5) for p in losses)
    rows = {r["trainer"]: r for r in report["rows"]}
    assert list(rows) == ["shardwise", "torch"]
    for name, row in rows.items():
        times = report["step_times_s"][name]
        assert len(times) == 2 and all(len(rnd) == 1 and rnd[0] > 0 for rnd in times)
        assert row["median_ms"] > 0 and row["activation_bytes"] > 0
    ratio = rows["shardwise"]["median_ms"] / rows["torch"]["median_ms"]
    assert rows["torch"]["shardwise_ratio"] == pytest.approx(ratio)
    # Both hold the same fp32 shards: half of every split tensor, all of the replicated ones; AdamW's moments
    # are twice the parameters plus one `step` scalar per tensor, in both.
    full = gpt_num_params(gpt_config("tiny", n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=64))
    assert 4 * full // 2 < rows["shardwise"]["params_bytes"] < 4 * full
    assert rows["shardwise"]["params_bytes"] == rows["torch"]["params_bytes"]
    assert rows["shardwise"]["optimizer_bytes"] == rows["torch"]["optimizer_bytes"]
    assert rows["shardwise"]["optimizer_bytes"] > 2 * rows["shardwise"]["params_bytes"]
    assert len(report["peak_rss_bytes_per_rank"]) == 2
