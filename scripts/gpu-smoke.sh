#!/usr/bin/env bash
# GPU smoke test: torchyard up on this machine's NVIDIA GPUs, train + predict + checks, then stop.
# See docs/gpu.md. Options are passed through (e.g. --allow-cpu, --models, --epochs, --json FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
exec "$python" scripts/gpu_smoke.py "$@"
