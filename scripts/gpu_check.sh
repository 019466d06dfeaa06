#!/usr/bin/env bash
# The GPU path in one command: phases A-D (benchmarks/gpu_check.py), each in its own process with a timeout,
# a CHECK / STATUS / VALUE / LIMIT table and a JSON file. On one H100/H200: under 6 minutes.
#
#   scripts/gpu_check.sh                                   # the GPU of LOCAL_RANK (default 0)
#   scripts/gpu_check.sh --device cpu --json out.json      # every phase on the CPU (the test suite runs this)
#
# PYTHON selects the interpreter (default: python3). Exit code 0 when no check failed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m benchmarks.gpu_check "$@"
