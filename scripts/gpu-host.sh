#!/usr/bin/env bash
# The GPU checks of a session lent a GPU host, as one command on that host (docs/gpu.md): install
# the wheels that ../shared/gpu-host/prepare-wheels.sh put in .whl (the host has CUDA PyTorch,
# torchvision, numpy and Pillow but none of our other dependencies, and no network), then the GPU
# smoke with the `gpu` tests (scripts/gpu-smoke.sh) and the GPU bench (scripts/gpu-bench.sh), each
# bounded in time so that one slow part still leaves the others' results. Everything they print
# and write goes under $OUT (default ./gpu-out): logs, the smoke's and the bench's JSON, and
# docs/benchmarks.md with the bench's GPU section written.
#   EXTRA="fastapi-offline==1.7.7 litserve==0.2.19 pyzmq pytest==9.2.0 pytest-timeout==2.4.0 iniconfig pluggy pygments" \
#     bash ../shared/gpu-host/prepare-wheels.sh        # here, with network
#   scripts/gpu-host.sh                                 # there
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
started=$(date +%s)
stamp() { echo "[$(( $(date +%s) - started )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$OUT/install.log" 2>&1
stamp "wheels installed (exit $?)"
export PYTHONPATH="/tmp/site:$PWD" PYTHON=python3
{ nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"; nproc; } >"$OUT/host.txt" 2>&1
timeout "${SMOKE_S:-200}" scripts/gpu-smoke.sh --models "${SMOKE_MODELS:-cifar_net,resnet18}" \
  --data-dir /tmp/gpu-smoke-data --json "$OUT/smoke.json" >"$OUT/smoke.log" 2>&1
stamp "smoke and gpu tests: exit $?"
tail -c 200000 /tmp/gpu-smoke-data/up.log >"$OUT/smoke-up.log" 2>/dev/null
timeout "${BENCH_S:-330}" scripts/gpu-bench.sh --write-docs --json "$OUT/bench.json" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
stamp "bench: exit $?"
for logs in /tmp/torchyard-bench-photos-*/logs; do  # kept when the bench failed or was cut short
  [ -d "$logs" ] && for f in "$logs"/*; do tail -c 100000 "$f" >"$OUT/bench-$(basename "$f")"; done
done
cp docs/benchmarks.md "$OUT/benchmarks.md"
tail -n 40 "$OUT/smoke.log"
tail -n 60 "$OUT/bench.log"
