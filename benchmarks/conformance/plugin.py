"""pytest plugin of a conformance run: each test's outcome, its start and end times, and the last line of its error.

Loaded with `-p benchmarks.conformance.plugin`; writes one JSON line per test to $SHARDWISE_CONFORMANCE_RESULTS.
It also imports the installed peer before the peer's conftest can put its source tree first on sys.path, so the
run tests the installed package (the one shardwise is compared with), not the checkout's sources.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import pytest

RESULTS_ENV = "SHARDWISE_CONFORMANCE_RESULTS"
# JSON {file path: regex}: in those files only tests whose name matches run (`suites.TORCH_SELECT`).
SELECT_ENV = "SHARDWISE_CONFORMANCE_SELECT"

if "deepspeed" in os.environ.get("SHARDWISE_CONFORMANCE_PEERS", ""):
    import deepspeed  # noqa: F401

_started: dict[str, float] = {}
_outcome: dict[str, tuple[str, str]] = {}


def _write(row: dict[str, Any]) -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _last_line(report: pytest.TestReport) -> str:
    text = str(report.longrepr or "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # The exception line ("E   ValueError: ...") says more than the location line that ends longrepr.
    errors = [line for line in lines if line.startswith("E ")]
    # torch's harness ends a failure with how to rerun it; the exception line above that is the one to keep.
    raised = [line for line in errors if re.match(r"E\s+[\w.]*(Error|Exception|Exit)\b", line)]
    chosen = raised[-1] if raised else errors[-1] if errors else (lines[-1] if lines else "")
    return chosen[:400]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    select: dict[str, str] = json.loads(os.environ.get(SELECT_ENV) or "{}")
    if not select:
        return
    kept, dropped = [], []
    for item in items:
        pattern = select.get(item.nodeid.split("::", 1)[0])
        (kept if pattern is None or re.search(pattern, item.name) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _started[nodeid] = time.time()


@pytest.hookimpl
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A test's outcome is its worst phase (failed > skipped > passed), written once its teardown has run."""
    nodeid = report.nodeid
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    phase = "failed" if report.failed else "skipped" if report.skipped else "passed"
    previous = _outcome.get(nodeid, ("passed", ""))
    if rank[phase] > rank[previous[0]]:
        _outcome[nodeid] = (phase, _last_line(report))
    if report.when != "teardown":
        return
    outcome, error = _outcome.pop(nodeid, ("passed", ""))
    _write({"nodeid": nodeid, "outcome": outcome, "start": _started.pop(nodeid, 0.0), "end": time.time(),
            "error": error})

