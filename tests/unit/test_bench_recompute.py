"""`shardwise bench recompute` on two ranks: every policy's row, equal first losses (recomputation is exact),
stored bytes ordered as the policies promise and within 10% of the planner's prediction."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks import recompute as bench


def test_tiny_run_on_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "recompute.json"
    code = bench.launch(2, ["--model", "tiny", "--seq", "32", "--micro-batch", "2", "--rounds", "2", "--warmup", "1",
                            "--json", str(out)])
    assert code == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["none", "selective", "full", "every_2"]
    assert len({r["first_loss"] for r in rows.values()}) == 1
    act = {name: r["activations"] for name, r in rows.items()}
    assert act["full"] < act["every_2"] < act["none"] and act["selective"] <= act["none"]
    for name in ("none", "selective", "full"):
        assert abs(rows[name]["activations"] / rows[name]["predicted"] - 1) <= 0.10, rows[name]
    assert math.isnan(rows["every_2"]["predicted"])
    assert all(r["median_ms"] > 0 and r["cuda_peak"] is None for r in rows.values())
