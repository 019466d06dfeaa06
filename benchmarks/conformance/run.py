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


def _pytest(cwd: Path, targets: list[str], *, swap: str, peers: str, work: Path, label: str,
            timeout_s: int, extra_env: dict[str, str]) -> tuple[Path, Path]:
    results = work / f"{label}.results.jsonl"
    log = work / f"{label}.access.tsv"
    for path in (results, log):
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
        "SHARDWISE_CONFORMANCE_RESULTS": str(results),
        "SHARDWISE_CONFORMANCE_LOG": str(log),
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
    print(f"  {label}: pytest exit {completed.returncode} in {time.time() - started:.0f} s "
          f"(log {work / (label + '.pytest.log')})", flush=True)
    return results, log


def run_peer(name: str, cwd: Path, files: list[str], *, work: Path, timeout_s: int, harness: tuple[str, ...],
             public: tuple[str, ...], reuse_peer: bool = False,
             extra_env: dict[str, str] | None = None) -> list[report.Verdict]:
    extra_env = extra_env or {}
    present = [f for f in files if (cwd / f).exists()]
    missing = sorted(set(files) - set(present))
    if missing:
        print(f"  {name}: not in this checkout, skipped: {', '.join(missing)}", flush=True)
    peer_results = work / f"{name}-peer.results.jsonl"
    if reuse_peer and peer_results.exists():
        # The peer's outcomes do not depend on shardwise: an earlier run's serve while shardwise changes.
        print(f"  {name}-peer: reusing {peer_results}", flush=True)
    else:
        peer_results, _ = _pytest(cwd, present, swap="", peers=name, work=work, label=f"{name}-peer",
                                  timeout_s=timeout_s, extra_env=extra_env)
    peer = {nodeid: r for nodeid, r in report.read_results(peer_results).items()
            if any(nodeid.startswith(f + "::") for f in present)}
    passed = [nodeid for nodeid, r in peer.items() if r.outcome == "passed"]
    if not passed:
        return []
    ours_results, log = _pytest(cwd, passed, swap=name, peers=name, work=work, label=f"{name}-shardwise",
                                timeout_s=timeout_s, extra_env=extra_env)
    pytest_log = (work / f"{name}-shardwise.pytest.log").read_text()
    return report.classify(peer, report.read_results(ours_results), report.read_log(log), harness=harness,
                           public=public, deliberate=suites.DELIBERATE, internal=suites.INTERNAL,
                           not_collected=report.collection_errors(pytest_log), gaps=suites.GAPS)


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
                        help="reuse the peer's results from an earlier run in --work (they do not depend on shardwise)")
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
                            public=suites.DEEPSPEED_PUBLIC_MODULES, reuse_peer=args.reuse_peer)
        sections["deepspeed"] = report.markdown("DeepSpeed's own tests (tests/unit), deepspeed swapped for shardwise",
                                                verdicts, "make conformance DEEPSPEED_SRC=DIR")
    if args.torch_src is not None:
        tests = args.torch_src.resolve() / "test"
        if not (tests / "distributed").is_dir():
            parser.error(f"--torch-src {args.torch_src}: no test/distributed there; give the root of a pytorch "
                         f"checkout")
        print("torch's test/distributed:", flush=True)
        verdicts = run_peer("torch", tests, chosen(suites.TORCH_FILES), work=args.work, timeout_s=args.timeout,
                            harness=(), public=(), reuse_peer=args.reuse_peer, extra_env=_torch_env(args.work))
        sections["torch"] = report.markdown("torch's own FSDP2 / FSDP / DDP tests, the wrappers swapped for shardwise's",
                                            verdicts, "make conformance TORCH_SRC=DIR")
    for text in sections.values():
        print(text)
    if args.out is not None:
        previous = args.out.read_text() if args.out.exists() else ""
        args.out.write_text(report.replace_sections(previous, sections))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
