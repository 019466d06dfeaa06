"""Run the peers' own tests against the peer and against shardwise, and write the conformance table.

    make conformance DEEPSPEED_SRC=~/src/DeepSpeed TORCH_SRC=~/src/pytorch
    python -m benchmarks.conformance.run --deepspeed-src DIR [--torch-src DIR] [--files SUBSTR ...] [--out FILE]

DEEPSPEED_SRC is a checkout of DeepSpeed's repository (its tests/ are used; the installed deepspeed package is the
peer); TORCH_SRC a checkout of pytorch's repository for the installed torch (its test/ is used). For each peer:
one pytest run of the candidate files (`suites.py`) with the peer, then one with shardwise swapped in
(`swap.py`) over the tests that passed with the peer, then the join and the classes (`report.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.conformance import report, suites

REPO = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "site"


def _pytest(cwd: Path, targets: list[str], files: list[str], *, swap: str, peers: str, work: Path, label: str,
            timeout_s: int, extra_env: dict[str, str]) -> None:
    """One pytest run of `targets` (node ids or files), folded into `work`'s results for `label`: the rows of
    `files` (the files the targets belong to) are replaced, the other files' kept (`report.merge_run`)."""
    results = work / f"{label}.results.jsonl"
    log = work / f"{label}.access.tsv"
    run_results = work / f"{label}.run.results.jsonl"
    run_log = work / f"{label}.run.access.tsv"
    for path in (run_results, run_log):
        path.unlink(missing_ok=True)
    env = dict(os.environ)
    path_parts = [str(SITE)]
    path_parts.append(str(REPO))
    if env.get("PYTHONPATH"):
        path_parts.append(env["PYTHONPATH"])
    env.update({
        "PYTHONPATH": os.pathsep.join(path_parts),
        "SHARDWISE_CONFORMANCE_SWAP": swap,
        "SHARDWISE_CONFORMANCE_PEERS": peers,
        "SHARDWISE_CONFORMANCE_RESULTS": str(run_results),
        "SHARDWISE_CONFORMANCE_LOG": str(run_log),
        "SHARDWISE_CONFORMANCE_TESTS": str(cwd),
        "DS_ACCELERATOR": "cpu",
        # DeepSpeed's CPU accelerator counts NUMA nodes as devices unless told how many ranks fit on the host;
        # its harness skips a 2- or 4-rank test when that count is lower.
        "LOCAL_SIZE": env.get("LOCAL_SIZE", "8"),
        "DS_UNITTEST_TIMEOUT": str(timeout_s),
    })
    env.update(extra_env)
    # Node ids go through a file: a few hundred of them would not fit a command line everywhere.
    args_file = work / f"{label}.targets"
    args_file.write_text("\n".join(targets) + "\n")
    command = [sys.executable, "-m", "pytest", "-p", "benchmarks.conformance.plugin", "-p", "no:cacheprovider",
               "-q", "--continue-on-collection-errors", "--timeout", str(timeout_s + 60), f"@{args_file}"]
    started = time.time()
    completed = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    (work / f"{label}.pytest.log").write_text(completed.stdout)
    report.merge_run(results, run_results, files)
    report.merge_run_log(log, run_log)
    report.merge_errors(work / f"{label}.collection.json", report.collection_errors(completed.stdout), files)
    print(f"  {label}: pytest exit {completed.returncode} in {time.time() - started:.0f} s "
          f"(log {work / (label + '.pytest.log')})", flush=True)


def run_peer(name: str, cwd: Path, files: list[str], *, work: Path, timeout_s: int, harness: tuple[str, ...],
             public: tuple[str, ...], candidates: list[str], reuse_peer: bool = False, peer_only: bool = False,
             extra_env: dict[str, str] | None = None) -> list[report.Verdict]:
    """Run `files` with the peer (unless reused) and then with shardwise; the verdicts cover every candidate file
    measured in `work` so far, this run's and earlier runs'."""
    extra_env = extra_env or {}
    present = [f for f in files if (cwd / f).exists()]
    missing = sorted(set(files) - set(present))
    if missing:
        print(f"  {name}: not in this checkout, skipped: {', '.join(missing)}", flush=True)
    peer_store = work / f"{name}-peer.results.jsonl"
    measured = {nodeid.split("::", 1)[0] for nodeid in report.read_results(peer_store)}
    # The peer's outcomes do not depend on shardwise: with reuse_peer, an earlier run's serve for its files.
    to_run = [f for f in present if not (reuse_peer and f in measured)]
    if reuse_peer and len(to_run) < len(present):
        print(f"  {name}-peer: reusing {peer_store} for {len(present) - len(to_run)} file(s)", flush=True)
    # One pytest per file: the results of each file are kept as soon as it has run.
    for f in to_run:
        _pytest(cwd, [f], [f], swap="", peers=name, work=work, label=f"{name}-peer", timeout_s=timeout_s,
                extra_env=extra_env)
    if peer_only:
        return []
    peer_all = report.read_results(peer_store)
    passed = [nodeid for nodeid, r in peer_all.items() if r.outcome == "passed"
              and nodeid.split("::", 1)[0] in present]
    if passed:
        _pytest(cwd, passed, present, swap=name, peers=name, work=work, label=f"{name}-shardwise",
                timeout_s=timeout_s, extra_env=extra_env)
    peer = {nodeid: r for nodeid, r in peer_all.items() if nodeid.split("::", 1)[0] in candidates}
    errors_store = work / f"{name}-shardwise.collection.json"
    not_collected = json.loads(errors_store.read_text()) if errors_store.exists() else {}
    return report.classify(peer, report.read_results(work / f"{name}-shardwise.results.jsonl"),
                           report.read_log(work / f"{name}-shardwise.access.tsv"), harness=harness,
                           public=public, deliberate=suites.DELIBERATE, internal=suites.INTERNAL,
                           not_collected=not_collected, gaps=suites.GAPS)


def _torch_env(work: Path) -> dict[str, str]:
    """test_distributed_spawn.py reads its backend, world size and a directory holding a `barrier` file from the
    environment; gloo over 2 ranks is what runs on CPU. Its class name depends on INIT_METHOD, which each test's
    setUp sets to a file:// URL before the ranks spawn and import the file again: set one here too, so that the
    class the ranks look up has the name the parent collected."""
    temp_dir = work / "torch_tmp"
    temp_dir.mkdir(parents=True, exist_ok=True)
    (temp_dir / "barrier").mkdir(exist_ok=True)
    return {"BACKEND": "gloo", "WORLD_SIZE": "2", "TEMP_DIR": str(temp_dir),
            "INIT_METHOD": f"file://{temp_dir / 'init_file'}",
            "SHARDWISE_CONFORMANCE_SELECT": json.dumps(suites.TORCH_SELECT)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-src", type=Path, help="a checkout of DeepSpeed's repository")
    parser.add_argument("--torch-src", type=Path, help="a checkout of pytorch's repository")
    parser.add_argument("--files", nargs="*", default=None,
                        help="run only the candidate files whose path contains one of these")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "conformance")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test before it counts as hung")
    parser.add_argument("--reuse-peer", action="store_true",
                        help="reuse the peer's results of the files an earlier run in --work measured (they do not "
                             "depend on shardwise)")
    parser.add_argument("--peer-only", action="store_true",
                        help="run the peer only (to fill --work's peer results ahead of the shardwise runs)")
    args = parser.parse_args(argv)
    if args.deepspeed_src is None and args.torch_src is None:
        parser.error("give --deepspeed-src DIR and/or --torch-src DIR (checkouts of the peers' repositories)")
    args.work.mkdir(parents=True, exist_ok=True)

    def chosen(files: list[str]) -> list[str]:
        return [f for f in files if args.files is None or any(s in f for s in args.files)]

    sections: dict[str, str] = {}
    if args.deepspeed_src is not None:
        tests = args.deepspeed_src.resolve() / "tests"
        if not (tests / "unit" / "common.py").exists():
            parser.error(f"--deepspeed-src {args.deepspeed_src}: no tests/unit/common.py there; give the root of a "
                         f"DeepSpeed checkout")
        print("DeepSpeed's tests/unit:", flush=True)
        verdicts = run_peer("deepspeed", tests, chosen(suites.DEEPSPEED_FILES), work=args.work,
                            timeout_s=args.timeout, harness=suites.DEEPSPEED_HARNESS,
                            public=suites.DEEPSPEED_PUBLIC_MODULES, candidates=suites.DEEPSPEED_FILES,
                            reuse_peer=args.reuse_peer, peer_only=args.peer_only)
        if not args.peer_only:
            sections["deepspeed"] = report.markdown(
                "DeepSpeed's own tests (tests/unit), deepspeed swapped for shardwise", verdicts,
                "make conformance DEEPSPEED_SRC=DIR")
    if args.torch_src is not None:
        tests = args.torch_src.resolve() / "test"
        if not (tests / "distributed").is_dir():
            parser.error(f"--torch-src {args.torch_src}: no test/distributed there; give the root of a pytorch "
                         f"checkout")
        print("torch's test/distributed:", flush=True)
        verdicts = run_peer("torch", tests, chosen(suites.TORCH_FILES), work=args.work, timeout_s=args.timeout,
                            harness=(), public=(), candidates=suites.TORCH_FILES, reuse_peer=args.reuse_peer,
                            peer_only=args.peer_only, extra_env=_torch_env(args.work))
        if not args.peer_only:
            sections["torch"] = report.markdown(
                "torch's own FSDP2 / FSDP / DDP tests, the wrappers swapped for shardwise's", verdicts,
                "make conformance TORCH_SRC=DIR")
    for text in sections.values():
        print(text)
    if args.out is not None:
        previous = args.out.read_text() if args.out.exists() else ""
        args.out.write_text(report.replace_sections(previous, sections))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
