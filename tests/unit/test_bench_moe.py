"""The MoE benchmark: its summary arithmetic, its formula, its round order and loss check, its argument errors
(no launch: `shardwise bench moe` is run by hand, its figures recorded in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from benchmarks import moe as bench
from shardwise.cli.bench import BENCHMARKS


def test_formula_is_tokens_k_hidden_bytes_four_times_per_layer() -> None:
    f = bench.formula(hidden=64, experts=4, top_k=2, layers=3, tokens=256, ep=2)
    # per layer: dispatch and combine, forward and backward
    assert f.calls == 4 * 3
    assert f.payload_bytes == 12 * 256 * 2 * 64 * 4
    assert f.off_rank_bytes == f.payload_bytes / 2                     # (P - 1) / P of it leaves the rank
    f4 = bench.formula(hidden=64, experts=4, top_k=1, layers=1, tokens=100, ep=4)
    assert (f4.payload_bytes, f4.off_rank_bytes) == (4 * 100 * 64 * 4, 3 * 100 * 64 * 4)


def test_summary_uses_medians_ratios_and_the_formula() -> None:
    times = {"shardwise": [[0.010, 0.012, 0.011], [0.020, 0.011, 0.013]],     # median of all six: 0.0115
             "deepspeed": [[0.023, 0.023, 0.500], [0.022, 0.024, 0.021]]}     # median: 0.023
    expected = bench.Formula(payload_bytes=1000.0, off_rank_bytes=500.0, calls=8)
    rows = {r.trainer: r for r in bench.summarize(times, {"shardwise": (1000.0, 64.0), "deepspeed": (1250.0, 0.0)},
                                                  tokens_per_step=512, expected=expected)}
    assert rows["shardwise"].median_ms == pytest.approx(11.5)
    assert rows["shardwise"].shardwise_ratio == pytest.approx(1.0)
    assert rows["deepspeed"].shardwise_ratio == pytest.approx(0.5)          # shardwise twice as fast
    assert rows["deepspeed"].paired_ratio == pytest.approx((0.011 / 0.023 + 0.013 / 0.022) / 2)
    assert rows["deepspeed"].tokens_per_s == pytest.approx(512 / 0.023)
    assert (rows["shardwise"].formula_ratio, rows["deepspeed"].formula_ratio) == (1.0, 1.25)
    assert rows["shardwise"].all_to_all_count_bytes == 64.0


def test_rounds_alternate_and_the_warmup_loss_check() -> None:
    assert [bench.round_order(r) for r in range(3)] == [
        [bench.Impl.SHARDWISE, bench.Impl.DEEPSPEED], [bench.Impl.DEEPSPEED, bench.Impl.SHARDWISE],
        [bench.Impl.SHARDWISE, bench.Impl.DEEPSPEED]]
    worst, message = bench.loss_mismatch([(2.0, 2.0), (1.5 + 1.5e-6, 1.5)], rtol=1e-5)
    assert message == "" and worst == pytest.approx(1e-6)
    worst, message = bench.loss_mismatch([(2.0, 2.0), (1.6, 1.5), (9.0, 1.0)], rtol=1e-5)
    assert worst == pytest.approx(8.0)
    assert "warm-up step 2 loss 1.6 vs DeepSpeed 1.5" in message and "> --rtol 1e-05" in message


@pytest.mark.parametrize("nproc,argv,fragment", [
    (1, [], "--nproc must be >= 2"),
    (2, ["--experts", "3"], "--experts = 3 must be a multiple of --nproc = 2"),
    (4, ["--experts", "2"], "--experts = 2 must be a multiple of --nproc = 4"),
    (2, ["--top-k", "6", "--experts", "4"], "--top-k = 6 > --experts = 4"),
])
def test_bad_shapes_are_rejected_before_launch(nproc: int, argv: list[str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("+", r"\+")):
        bench.launch(nproc, argv)


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--capacity-factor", "0"], ["--hidden", "x"]])
def test_bad_option_exits_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.launch(2, argv)
    assert exc.value.code == 2


def test_registered_as_a_bench_command() -> None:
    assert "moe" in BENCHMARKS and "DeepSpeed" in BENCHMARKS["moe"]
