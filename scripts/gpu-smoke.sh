#!/usr/bin/env bash
# GPU smoke test: torchyard up on this machine's NVIDIA GPUs, train + predict + checks, then stop.
# See docs/gpu.md. Options are passed through (e.g. --allow-cpu, --models, --epochs, --json FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
"$python" scripts/gpu_smoke.py "$@"
# The tests that need CUDA (skipped everywhere else): fp16 GradScaler resume, the serving graph
# traced on the GPU, pinned staging buffers and their events, a provoked device-side assert.
# Named by file: collecting the whole suite would import test tools a bare GPU host lacks.
if command -v nvidia-smi >/dev/null 2>&1; then
    "$python" -m pytest -m gpu -q -rs -p no:cacheprovider tests/worker/test_gpu.py tests/e2e/test_gpu.py
else
    echo "no nvidia-smi: the gpu-marked tests were not run"
fi
