#!/usr/bin/env bash
# Install a CPU-friendly torch into the given interpreter's environment before anything else asks for
# torch (a bare `torch` requirement pulls a multi-GB CUDA build on Linux).
#  1. torch already importable: keep it.
#  2. CUDA machine (nvidia-smi works): the default wheel, which is the CUDA build.
#  3. otherwise torch==2.13.0 (a CPU build that may lie on local disk), then PyTorch's CPU index.
set -euo pipefail
PY=${1:-python3}
if "$PY" -c "import torch" 2>/dev/null; then
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch>=2.4"
    exit 0
fi
"$PY" -m pip install --quiet "torch==2.13.0" \
    || "$PY" -m pip install --quiet torch --index-url https://download.pytorch.org/whl/cpu
