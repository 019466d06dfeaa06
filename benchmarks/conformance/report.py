"""Join a peer run and a shardwise run of the same tests, class each failure, and write the table."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Outcome:
    nodeid: str
    outcome: str            # passed | failed | skipped
    start: float
    end: float
    error: str

    @property
    def file(self) -> str:
        return self.nodeid.split("::", 1)[0]


@dataclass
class Access:
    time: float
    kind: str               # ours | theirs
    name: str


@dataclass
class Verdict:
    nodeid: str
    passed: bool
    exercised_ours: bool     # the test read at least one shardwise name while it ran
    klass: str = ""          # "", or a, b, c for a failure
    reason: str = ""


@dataclass
class FileRow:
    file: str
    peer_passed: int = 0
    ours_passed: int = 0
    ours_passed_exercising: int = 0
    exercising: int = 0
    classes: dict[str, int] = field(default_factory=lambda: {"a": 0, "b": 0, "c": 0})


def read_results(path: Path) -> dict[str, Outcome]:
    results: dict[str, Outcome] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            results[row["nodeid"]] = Outcome(row["nodeid"], row["outcome"], row["start"], row["end"],
                                                row["error"])
    return results


def read_log(path: Path) -> list[Access]:
    accesses = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 4:
                accesses.append(Access(float(parts[0]), parts[2], parts[3]))
    accesses.sort(key=lambda a: a.time)
    return accesses


def merge_run(store: Path, run: Path, files: list[str]) -> None:
    """Fold one run's results (JSON lines) into the results kept across runs: the rows of the files the run
    covered are replaced, the other files' rows kept, so that runs over a few files at a time add up."""
    ran = set(files)
    kept = [line for line in (store.read_text().splitlines() if store.exists() else [])
            if json.loads(line)["nodeid"].split("::", 1)[0] not in ran]
    new = run.read_text().splitlines() if run.exists() else []
    temporary = store.with_name(store.name + ".tmp")
    temporary.write_text("".join(line + "\n" for line in [*kept, *new]))
    temporary.replace(store)


def merge_run_log(store: Path, run: Path) -> None:
    """Append one run's access log to the log kept across runs: lines are joined to tests by time, so an earlier
    run's lines fall in no window of a test that ran again."""
    if run.exists():
        with store.open("a") as f:
            f.write(run.read_text())


def merge_errors(store: Path, errors: dict[str, str], files: list[str]) -> dict[str, str]:
    """The collection errors kept across runs (a JSON file): the covered files' entries are this run's."""
    merged = {f: e for f, e in (json.loads(store.read_text()) if store.exists() else {}).items() if f not in files}
    merged.update(errors)
    store.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    return merged


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_of(name: str) -> str:
    """deepspeed.runtime.zero.partition_parameters.ZeroParamStatus -> its module (drop the attribute)."""
    return name.rsplit(".", 1)[0] if "." in name else name


def collection_errors(pytest_log: str) -> dict[str, str]:
    """file -> why it did not import, from pytest's short summary ("ERROR path.py - Error: message")."""
    errors = {}
    for line in pytest_log.splitlines():
        text = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        match = re.match(r"ERROR (\S+\.py) - (.*)", text)
        if match:
            errors[match.group(1)] = match.group(2)
    return errors


def classify(peer: dict[str, Outcome], ours: dict[str, Outcome], log: list[Access], *,
             harness: tuple[str, ...], public: tuple[str, ...], deliberate: dict[str, str],
             internal: dict[str, str], not_collected: dict[str, str] | None = None,
             gaps: dict[str, str] | None = None) -> list[Verdict]:
    verdicts = []
    for nodeid, theirs in sorted(peer.items()):
        if theirs.outcome != "passed":
            continue
        mine = ours.get(nodeid)
        window = [a for a in log if mine is not None and mine.start <= a.time <= mine.end]
        exercised = any(a.kind == "ours" for a in window)
        if mine is not None and mine.outcome == "passed":
            verdicts.append(Verdict(nodeid, True, exercised))
            continue
        if mine is not None:
            error = mine.error
        elif theirs.file in (not_collected or {}):
            error = f"its file does not import under shardwise: {(not_collected or {})[theirs.file]}"
        else:
            error = "not run under shardwise"
        reached = sorted({_module_of(a.name) for a in window if a.kind == "theirs"
                          and not _under(a.name, harness) and not _under(a.name, public)})
        deliberate_reason = next((r for key, r in deliberate.items() if key in nodeid), None)
        internal_reason = next((r for key, r in internal.items() if key in nodeid), None)
        gap_reason = next((r for key, r in (gaps or {}).items() if key in nodeid), None)
        if gap_reason is not None:
            verdict = Verdict(nodeid, False, exercised, "a", f"{gap_reason} ({error})")
        elif deliberate_reason is not None:
            verdict = Verdict(nodeid, False, exercised, "c", deliberate_reason)
        elif internal_reason is not None:
            verdict = Verdict(nodeid, False, exercised, "b", internal_reason)
        elif reached:
            verdict = Verdict(nodeid, False, exercised, "b", "reaches " + ", ".join(reached) + f" ({error})")
        else:
            verdict = Verdict(nodeid, False, exercised, "a", error)
        verdicts.append(verdict)
    return verdicts


def rows(verdicts: list[Verdict]) -> list[FileRow]:
    by_file: dict[str, FileRow] = {}
    for v in verdicts:
        row = by_file.setdefault(v.nodeid.split("::", 1)[0], FileRow(v.nodeid.split("::", 1)[0]))
        row.peer_passed += 1
        row.exercising += v.exercised_ours
        if v.passed:
            row.ours_passed += 1
            row.ours_passed_exercising += v.exercised_ours
        else:
            row.classes[v.klass] += 1
    return [by_file[f] for f in sorted(by_file)]


def markdown(title: str, verdicts: list[Verdict], command: str) -> str:
    table = rows(verdicts)
    total = FileRow("all files")
    for r in table:
        total.peer_passed += r.peer_passed
        total.ours_passed += r.ours_passed
        total.ours_passed_exercising += r.ours_passed_exercising
        total.exercising += r.exercising
        for k in total.classes:
            total.classes[k] += r.classes[k]
    lines = [f"### {title}", "", f"`{command}`", "",
             "| file | pass with the peer | pass with shardwise | of which exercise shardwise | "
             "(a) gap | (b) peer internals | (c) deliberate |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in [*table, total]:
        name = f"**{r.file}**" if r is total else f"`{r.file}`"
        lines.append(f"| {name} | {r.peer_passed} | {r.ours_passed} | {r.ours_passed_exercising} of "
                     f"{r.exercising} | {r.classes['a']} | {r.classes['b']} | {r.classes['c']} |")
    share = 100.0 * total.ours_passed / total.peer_passed if total.peer_passed else 0.0
    exercised_share = (100.0 * total.ours_passed_exercising / total.exercising) if total.exercising else 0.0
    lines += ["", f"{total.ours_passed} of {total.peer_passed} ({share:.0f}%) pass with shardwise; of the "
              f"{total.exercising} that exercise shardwise, {total.ours_passed_exercising} ({exercised_share:.0f}%).",
              ""]
    failures = [v for v in verdicts if not v.passed]
    if failures:
        lines += ["| test | class | reason |", "|---|---|---|"]
        for v in sorted(failures, key=lambda v: (v.klass, v.nodeid)):
            reason = v.reason.replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| `{v.nodeid}` | ({v.klass}) | {reason} |")
        lines.append("")
    return "\n".join(lines)


PAGE_HEAD = """# Conformance with the peers' own test suites

The peers' own unit tests, run on this CPU against the peer and then against shardwise swapped in
(`benchmarks/conformance/`). Counted: the tests of the candidate files that pass with the peer itself. A failure
under shardwise is classed (a) a gap in public API, (b) a test of the peer's internals (the module named), or
(c) a deliberate difference (README). "Exercise shardwise": the test read at least one name shardwise provides while
it ran; the others ran only the peer's own code (its config or scheduler classes, for instance).
"""


def replace_sections(page: str, sections: dict[str, str]) -> str:
    """The page with each peer's section replaced (between `<!-- peer -->` markers); other peers' kept."""
    if not page.strip():
        page = PAGE_HEAD
    for peer, text in sections.items():
        start, end = f"<!-- {peer} -->", f"<!-- /{peer} -->"
        block = f"{start}\n{text}\n{end}"
        if start in page and end in page:
            page = page[:page.index(start)] + block + page[page.index(end) + len(end):]
        else:
            page = page.rstrip("\n") + "\n\n" + block + "\n"
    return page
