"""The planner's step time against the engine's on this machine: within 25% for at least six configurations,
one or more of them on two ranks, after calibrating in the same run.

`benchmarks.planner_check` calibrates and measures side by side: each world size (1 and 2 gloo ranks)
is a group of processes that lives for the whole test, the groups take turns one round at a time, and each
round of a group runs the calibration probes of `shardwise plan --calibrate` and then a few timed optimizer
steps of each of its engine configurations. So the calibration sees the load the engine sees (this machine is
shared), and both sides are medians over the rounds. The prediction is `planner.step_time` on the calibrated
cluster (torch-free arithmetic); nothing of the engine's timings goes into it.
"""

from __future__ import annotations

from benchmarks.planner_check import CASES, render, run

TOLERANCE = 0.25


def test_predicted_step_time_is_within_25_percent_of_the_engine_after_calibrating() -> None:
    report = run(CASES, rounds=4, steps=2, samples=2)
    table = render(report)
    print(table)
    for ranks, cluster in report.clusters.items():
        assert cluster.num_gpus == ranks and cluster.source.startswith("measured on")
        assert cluster.compute_efficiency == 1.0 and cluster.attention_flops > 0 and cluster.optimizer_tensor_s > 0
    for row in report.rows:                       # the parts the cases exercise are all there
        t = row.predicted
        assert t.compute_s > 0 and t.optimizer_s > 0
        assert (t.dp_comm_s > 0) == (row.case.dp > 1)
    assert {r.case.zero for r in report.rows if r.case.dp == 2} == {0, 1, 2, 3}
    within = report.within(TOLERANCE)
    assert len(within) >= 6, f"fewer than 6 of {len(report.rows)} within {TOLERANCE:.0%}:\n{table}"
    assert any(r.case.dp == 2 for r in within), f"no two-rank case within {TOLERANCE:.0%}:\n{table}"
