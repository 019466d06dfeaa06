"""The conformance harness's own logic: classing failures from the swap log, and the page's sections."""

from __future__ import annotations

from benchmarks.conformance import report
from benchmarks.conformance.report import Access, Outcome


def _result(nodeid: str, outcome: str, start: float, end: float, error: str = "") -> Outcome:
    return Outcome(nodeid, outcome, start, end, error)


def test_failures_are_classed_from_what_the_test_read_while_it_ran() -> None:
    peer = {n: _result(n, "passed", 0, 1) for n in ("f.py::gap", "f.py::internal", "f.py::ok", "f.py::deliberate",
                                                     "f.py::public_path")}
    peer["f.py::peer_failed"] = _result("f.py::peer_failed", "failed", 0, 1)
    ours = {
        "f.py::gap": _result("f.py::gap", "failed", 10, 11, "E  TypeError: x"),
        "f.py::internal": _result("f.py::internal", "failed", 20, 21, "E  KeyError"),
        "f.py::ok": _result("f.py::ok", "passed", 30, 31),
        "f.py::deliberate": _result("f.py::deliberate", "failed", 40, 41, "E  UserError"),
        "f.py::public_path": _result("f.py::public_path", "failed", 50, 51, "E  AttributeError"),
    }
    log = [Access(10.5, "ours", "deepspeed.initialize"),
           Access(20.5, "ours", "deepspeed.initialize"),
           Access(20.6, "theirs", "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"),
           Access(20.7, "theirs", "deepspeed.accelerator.get_accelerator"),     # harness: ignored
           Access(50.5, "theirs", "deepspeed.runtime.lr_schedules.OneCycle"),   # public path: still a gap
           Access(60.0, "theirs", "deepspeed.runtime.engine.X")]                # outside every test's window
    verdicts = {v.nodeid: v for v in report.classify(
        peer, ours, log, harness=("deepspeed.accelerator",), public=("deepspeed.runtime.lr_schedules",),
        deliberate={"::deliberate": "documented"}, internal={})}
    assert "f.py::peer_failed" not in verdicts
    assert (verdicts["f.py::gap"].klass, verdicts["f.py::gap"].reason) == ("a", "E  TypeError: x")
    assert verdicts["f.py::internal"].klass == "b"
    assert "deepspeed.runtime.zero.stage3" in verdicts["f.py::internal"].reason
    assert "accelerator" not in verdicts["f.py::internal"].reason
    assert verdicts["f.py::ok"].passed and not verdicts["f.py::ok"].exercised_ours
    assert verdicts["f.py::deliberate"].klass == "c"
    assert verdicts["f.py::public_path"].klass == "a"
    table = report.markdown("t", list(verdicts.values()), "cmd")
    assert "1 of 5 (20%) pass with shardwise" in table


def test_a_peer_section_is_replaced_and_the_others_kept() -> None:
    page = report.replace_sections("", {"deepspeed": "first"})
    page = report.replace_sections(page, {"torch": "torch table"})
    page = report.replace_sections(page, {"deepspeed": "second"})
    assert "second" in page and "first" not in page and "torch table" in page
    assert page.count("<!-- deepspeed -->") == 1


def test_a_swapped_module_serves_ours_first_and_logs_each_side(tmp_path, monkeypatch) -> None:
    import types

    from benchmarks.conformance import swap

    log = tmp_path / "access.tsv"
    monkeypatch.setenv(swap.LOG_ENV, str(log))
    ours = types.ModuleType("shardwise.fake")
    ours.shared = "ours"
    theirs = types.ModuleType("deepspeed.fake")
    theirs.shared, theirs.only_theirs = "theirs", "theirs"
    module = swap.SwappedModule("deepspeed.fake", ours, theirs)
    assert module.shared == "ours"
    assert module.only_theirs == "theirs"
    try:
        module.missing
    except AttributeError as error:
        assert "missing" in str(error)
    else:
        raise AssertionError("a name in neither module must raise AttributeError")
    kinds = [line.split("\t")[2:] for line in log.read_text().splitlines()]
    assert kinds == [["ours", "deepspeed.fake.shared"], ["theirs", "deepspeed.fake.only_theirs"]]


def test_a_file_that_does_not_import_names_the_error() -> None:
    log = ("\x1b[31mERROR\x1b[0m unit/runtime/test_a.py - AttributeError: __compatible_ops__\n"
           "ERROR unit/b.py::T::test - not a collection error\n")
    errors = report.collection_errors(log)
    assert errors == {"unit/runtime/test_a.py": "AttributeError: __compatible_ops__"}
    peer = {"unit/runtime/test_a.py::t": _result("unit/runtime/test_a.py::t", "passed", 0, 1)}
    (verdict,) = report.classify(peer, {}, [], harness=(), public=(), deliberate={}, internal={},
                                 not_collected=errors)
    assert verdict.klass == "a" and "__compatible_ops__" in verdict.reason


def test_the_deepspeed_harness_fix_returns_a_failed_assertion_as_an_exception() -> None:
    import types

    import pytest

    from benchmarks.conformance import harness

    class Outcome(BaseException):
        pass

    class DistributedExec:
        def _dist_run(self, fail: bool) -> str:
            if fail:
                raise Outcome("DID NOT RAISE")
            return "ok"

    module = types.ModuleType("unit.common")
    module.DistributedExec = DistributedExec
    harness.FIXES["unit.common"](module)
    runner = DistributedExec()
    assert runner._dist_run(False) == "ok"
    assert DistributedExec._dist_run.__name__ == "_dist_run"      # the pool pickles the method by this name
    with pytest.raises(RuntimeError, match="Outcome: DID NOT RAISE"):
        runner._dist_run(True)


def test_runs_over_a_few_files_add_up(tmp_path) -> None:
    """A run replaces the rows of the files it covered and keeps the other files' (runs a few files at a time);
    collection errors likewise."""
    import json

    store, run = tmp_path / "store.jsonl", tmp_path / "run.jsonl"

    def rows(*items: tuple[str, str]) -> str:
        return "".join(json.dumps({"nodeid": n, "outcome": o, "start": 0, "end": 1, "error": ""}) + "\n"
                       for n, o in items)

    run.write_text(rows(("a.py::x", "failed"), ("b.py::y", "passed")))
    report.merge_run(store, run, ["a.py", "b.py"])
    run.write_text(rows(("a.py::x", "passed"), ("a.py::z", "passed")))
    report.merge_run(store, run, ["a.py"])
    merged = report.read_results(store)
    assert {n: r.outcome for n, r in merged.items()} == {"a.py::x": "passed", "a.py::z": "passed",
                                                        "b.py::y": "passed"}
    run.write_text("")                         # a file that now yields no test at all loses its old rows
    report.merge_run(store, run, ["b.py"])
    assert set(report.read_results(store)) == {"a.py::x", "a.py::z"}
    errors = tmp_path / "errors.json"
    assert report.merge_errors(errors, {"a.py": "ImportError"}, ["a.py", "b.py"]) == {"a.py": "ImportError"}
    assert report.merge_errors(errors, {"b.py": "E"}, ["b.py"]) == {"a.py": "ImportError", "b.py": "E"}
    assert report.merge_errors(errors, {}, ["a.py"]) == {"b.py": "E"}


def test_torch_wrappers_log_each_call_and_keep_their_identity(tmp_path, monkeypatch) -> None:
    """torch's swapped wrappers: a call of a function or a construction of a class is logged as shardwise's,
    whoever makes it; a class stays the same class (isinstance checks), wrapped once."""
    from benchmarks.conformance import swap

    log = tmp_path / "access.tsv"
    monkeypatch.setenv(swap.LOG_ENV, str(log))

    class Wrapper:
        def __init__(self, value: int) -> None:
            self.value = value

    original_init = Wrapper.__init__
    monkeypatch.setattr(Wrapper, "__init__", original_init)      # restored after the test
    shard = swap._calls_logged("shardwise.shard", lambda x: x + 1)
    cls = swap._calls_logged("shardwise.Wrapper", Wrapper)
    assert cls is Wrapper and swap._calls_logged("shardwise.Wrapper", Wrapper) is Wrapper
    assert shard(1) == 2 and Wrapper(3).value == 3 and isinstance(Wrapper(4), Wrapper)
    names = [line.split("\t")[2:] for line in log.read_text().splitlines()]
    # every call, a repeat within the throttle window too (tests a tenth of a second long follow each other)
    assert names == [["ours", "shardwise.shard"], ["ours", "shardwise.Wrapper"], ["ours", "shardwise.Wrapper"]], names
