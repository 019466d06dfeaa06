"""Each node's own record of a multi-node run.

Global rank 0 (on node 0) draws the progress bar and writes metrics.jsonl and summary.json; the other
nodes would otherwise leave nothing but their arguments file. So local rank 0 of every node K writes
RUN_DIR/nodeK.log (start, a line every `steps_per_print` steps with this node's step time, the end) and
a summary row RUN_DIR/nodeK.json (node rank, host, its global and local ranks, steps, final loss, mean
step time, peak memory of each local rank), and prints that row on its node's stdout, so it is seen even
where RUN_DIR is not on a shared filesystem. Single-node runs write neither (summary.json says it all).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from shardwise.telemetry.metrics import format_bytes


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: set by torchrun in each rank's environment."""

    global_rank: int
    node_rank: int
    nnodes: int
    local_rank: int
    host: str

    @classmethod
    def from_env(cls, global_rank: int) -> "RankPlace":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        world = int(os.environ.get("WORLD_SIZE", str(local_world)))
        nnodes = int(os.environ.get("GROUP_WORLD_SIZE", str(max(1, world // local_world))))
        return cls(global_rank=global_rank, node_rank=int(os.environ.get("GROUP_RANK", "0")), nnodes=nnodes,
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")), host=socket.gethostname())


def _spans(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, ranks = [], sorted(ranks)
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


class NodeLog:
    """Node K's log and summary row; every method is a no-op except on local rank 0 of a multi-node run.

    `places` is every rank's RankPlace in global-rank order (one all-gather at start-up).
    """

    def __init__(self, out: str | os.PathLike[str], me: RankPlace, places: Sequence[RankPlace], *,
                 steps_per_print: int):
        self.me = me
        self.enabled = me.nnodes > 1 and me.local_rank == 0
        self.mine = sorted((p for p in places if p.node_rank == me.node_rank), key=lambda p: p.global_rank)
        self.steps_per_print = max(1, steps_per_print)
        self.log_path = Path(out) / f"node{me.node_rank}.log"
        self.row_path = Path(out) / f"node{me.node_rank}.json"
        self._times: list[float] = []
        self._loss = float("nan")
        self._start = time.perf_counter()
        if self.enabled:                # appended: a resumed run continues its node's log
            ranks = [p.global_rank for p in self.mine]
            self.write(f"node {me.node_rank} of {me.nnodes} on {me.host}: global ranks {_spans(ranks)} "
                       f"(local 0-{len(ranks) - 1})")

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}\n")

    def step(self, step: int, total: int, loss: float, step_time_s: float) -> None:
        self._times.append(step_time_s)
        self._loss = loss
        if step == 1 or step == total or step % self.steps_per_print == 0:
            self.write(f"step {step}/{total} | loss {loss:.4f} | {step_time_s:.3f} s/step on this node")

    def row(self, memory: Sequence[Mapping[str, int]]) -> dict[str, Any]:
        """The summary row; `memory` is every rank's memory report in global-rank order."""
        steady = self._times[1:] or self._times
        return {"node_rank": self.me.node_rank, "nnodes": self.me.nnodes, "host": self.me.host,
                "global_ranks": [p.global_rank for p in self.mine], "local_ranks": [p.local_rank for p in self.mine],
                "steps": len(self._times), "final_loss": self._loss,
                "mean_step_time_s": sum(steady) / len(steady) if steady else None,
                "peak_rss_bytes": [int(memory[p.global_rank].get("peak_rss", 0)) for p in self.mine],
                "wall_time_s": time.perf_counter() - self._start}

    def finish(self, memory: Sequence[Mapping[str, int]]) -> None:
        """Write nodeK.json, the last log line, and print the row on this node's stdout."""
        if not self.enabled:
            return
        row = self.row(memory)
        self.row_path.write_text(json.dumps(row, indent=1) + "\n", encoding="utf-8")
        step_s = "-" if row["mean_step_time_s"] is None else f"{row['mean_step_time_s']:.3f}"
        line = (f"node {row['node_rank']} ({row['host']}): global ranks {_spans(row['global_ranks'])}, "
                f"{row['steps']} steps, final loss {row['final_loss']:.4f}, {step_s} s/step, peak RSS "
                + ", ".join(format_bytes(b) for b in row["peak_rss_bytes"]))
        self.write(line)
        print(f"{line}; wrote {self.log_path} and {self.row_path}", flush=True)

