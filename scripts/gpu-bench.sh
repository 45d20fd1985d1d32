#!/usr/bin/env bash
# The photo workload end to end (bench/photos.py) on this host: resnet18 at 224 on its first GPU,
# or the CPU twin where torch sees no GPU; one table, and with --write-docs this host's section of
# docs/benchmarks.md. Options pass through (--write-docs, --json FILE, --litserve skip, ...).
# Needs no virtualenv: a GPU host's python3 with the wheels of prepare-wheels.sh on PYTHONPATH will do.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
# One bench at a time on a host: a second one would take the first one's cores.
if command -v flock >/dev/null 2>&1; then
  exec flock /tmp/torchyard-bench.lock "$python" bench/photos.py "$@"
fi
exec "$python" bench/photos.py "$@"
