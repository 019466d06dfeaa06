#!/usr/bin/env bash
# Install a CPU-friendly torch into the given interpreter's environment before anything else asks for
# torch (a bare `torch` requirement pulls a multi-GB CUDA build on Linux).
#  1. torch already importable: keep it.
#  2. CUDA machine (nvidia-smi works): the default wheel, which is the CUDA build.
#  3. otherwise torch==2.13.0 (the CPU build this project's machines keep on local disk); where that release
#     cannot be had, the default torch wheel (TORCH_SPEC overrides, e.g. a CPU-only wheel file or index).
set -euo pipefail
PY=${1:-python3}
if "$PY" -c "import torch" 2>/dev/null; then
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch>=2.4"
    exit 0
fi
if [ -n "${TORCH_SPEC:-}" ]; then
    "$PY" -m pip install --quiet $TORCH_SPEC
    exit 0
fi
"$PY" -m pip install --quiet "torch==2.13.0" || {
    echo "install_torch: torch==2.13.0 is not available here; installing the default torch wheel" \
         "(set TORCH_SPEC to choose a CPU-only build)" >&2
    "$PY" -m pip install --quiet "torch>=2.4"
}
