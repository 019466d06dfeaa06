"""The step-time model against published large-scale runs (benchmarks/planner_published.py holds the rows,
each with its paper, table and row: Narayanan et al. 2021 Tables 1 and 2, Korthikanti et al. 2022 Table 5).

Bounds, and why these: the published figures are rounded (integer teraFLOP/s, about 1%); the rows come from
two papers a year apart whose software differs (Korthikanti's full-recomputation 530B runs about 10% faster
than Narayanan's same model), so one physical model fitted once cannot be expected to come closer than about
10% on every row. Held-out rows (not among those the preset's two figures were fitted on) must therefore stay
within 15% each (the issue's target for Table 2) and 8% on average; Korthikanti's iteration times within 10%;
Table 2's ZeRO-3-vs-PTD-P verdict as the paper's for every model size and GPU count; and the error no longer
trends with model size (before: +14% at 1.7B, -14% at 1T, a slope of -0.04 per e-fold of parameters).
"""

from __future__ import annotations

import pytest

from benchmarks.planner_published import FIT, K22_T5, N21_T1, N21_T2, ROWS, predict_all, ranking_agrees, stats

PREDS = predict_all()


def test_rows_are_the_papers_and_the_fit_used_only_some() -> None:
    assert len(ROWS) == 30 and {r.source for r in ROWS} == {N21_T1, N21_T2, K22_T5}
    assert len({r.key for r in ROWS}) == len(ROWS) and FIT <= {r.key for r in ROWS}
    held = [p for p in PREDS if not p.fitted]
    assert len(held) == 20 and {p.row.source for p in held} == {N21_T1, N21_T2, K22_T5}


def test_held_out_rows_within_15_percent_and_8_on_average() -> None:
    held = [p for p in PREDS if not p.fitted]
    worst = max(held, key=lambda p: abs(p.ratio - 1))
    assert abs(worst.ratio - 1) < 0.15, f"{worst.row.key}: {worst.predicted:.3g} vs {worst.row.value}"
    assert stats(held).mean_abs < 0.08


def test_korthikanti_iteration_times_within_10_percent() -> None:
    for p in PREDS:
        if p.row.source == K22_T5:
            assert p.predicted == pytest.approx(p.row.value, rel=0.10), p.row.key


def test_table2_zero3_against_ptdp_ranked_as_the_paper() -> None:
    agree = ranking_agrees(PREDS)
    assert len(agree) == 6 and all(agree.values()), agree
    for p in PREDS:
        if p.row.source == N21_T2:
            assert p.predicted == pytest.approx(p.row.value, rel=0.15), p.row.key


def test_error_no_longer_trends_with_model_size() -> None:
    table1 = [p for p in PREDS if p.row.source == N21_T1]
    assert abs(stats(table1).trend) < 0.02
    small, large = table1[0], table1[-1]          # 1.7B was over-predicted by 14%, 1T under by 14%
    assert abs(small.ratio - 1) < 0.08 and abs(large.ratio - 1) < 0.08


def test_every_published_run_fits_in_memory() -> None:
    assert all(p.fits for p in PREDS), [p.row.key for p in PREDS if not p.fits]
