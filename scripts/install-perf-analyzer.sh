#!/usr/bin/env bash
# Triton's perf_analyzer, from the package registries, into .tools/perf_analyzer/ (git-ignored),
# without a GPU; then `.tools/perf_analyzer/run ARGS` runs it with its libraries.
#
# What runs on a glibc older than 2.38 (Debian 12: 2.36), as measured in /work/shared/real-components.md:
# - the binary inside the tritonclient==2.51.0 manylinux1 wheel (later wheels, and the
#   `perf-analyzer` package's real wheels, need glibc 2.38; on this glibc it resolves to a placeholder);
# - libb64.so.0d from Debian's libb64-0d (apt-get download: no root needed);
# - libcudart.so.12 from PyPI's nvidia-cuda-runtime-cu12 (it loads without a GPU).
# Idempotent: an install that answers --version is kept. Exit 0 on success, 1 with the reason.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${PERF_ANALYZER_DIR:-$ROOT/.tools/perf_analyzer}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
WHEEL_VERSION=2.51.0

if [ -x "$DEST/run" ] && "$DEST/run" --version >/dev/null 2>&1; then
  echo "perf_analyzer already installed in $DEST"
  exit 0
fi

fail() { echo "perf_analyzer not installed: $*" >&2; exit 1; }
[ "$(uname -m)" = x86_64 ] || fail "the manylinux1 wheel's binary is for x86_64, this is $(uname -m)"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$DEST/bin" "$DEST/lib"

echo "perf_analyzer: tritonclient==$WHEEL_VERSION (manylinux1 wheel) ..."
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
  -d "$WORK/dl" "tritonclient==$WHEEL_VERSION" || fail "pip could not download tritonclient==$WHEEL_VERSION"
"$PYTHON" -m zipfile -e "$WORK"/dl/tritonclient-"$WHEEL_VERSION"-*.whl "$WORK/tc"
BINARY="$(find "$WORK/tc" -path '*data/bin/perf_analyzer' -type f | head -n1)"
[ -n "$BINARY" ] || fail "no perf_analyzer binary in the wheel"
install -m 0755 "$BINARY" "$DEST/bin/perf_analyzer"

echo "perf_analyzer: libb64-0d (Debian) ..."
if ! ( cd "$WORK" && apt-get download libb64-0d >/dev/null 2>&1 ); then
  ( apt-get update -qq >/dev/null 2>&1 || true; cd "$WORK" && apt-get download libb64-0d >/dev/null 2>&1 ) \
    || fail "apt-get download libb64-0d failed (no apt, or no Debian/Ubuntu package lists)"
fi
dpkg -x "$WORK"/libb64-0d_*.deb "$WORK/b64"
cp -a "$WORK"/b64/usr/lib/*/libb64.so* "$DEST/lib/"

echo "perf_analyzer: libcudart.so.12 (nvidia-cuda-runtime-cu12) ..."
"$PYTHON" -m pip install --quiet --no-deps --target "$WORK/cudart" "nvidia-cuda-runtime-cu12>=12,<13" \
  || fail "pip could not install nvidia-cuda-runtime-cu12"
cp -a "$WORK"/cudart/nvidia/cuda_runtime/lib/libcudart.so* "$DEST/lib/"

cat > "$DEST/run" <<'EOF'
#!/usr/bin/env bash
# perf_analyzer with the libraries installed beside it (scripts/install-perf-analyzer.sh).
HERE="$(cd "$(dirname "$0")" && pwd)"
export LD_LIBRARY_PATH="$HERE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$HERE/bin/perf_analyzer" "$@"
EOF
chmod +x "$DEST/run"
"$DEST/run" --version >/dev/null 2>&1 || fail "the binary does not run: $("$DEST/run" --version 2>&1 | tail -n1)"
echo "perf_analyzer installed: $DEST/run ($("$DEST/run" --version 2>&1 | head -n1))"
