"""The Docker image's entrypoints, run as plain processes: the `api` and `worker-cpu` services'
commands from docker-compose.yml with their compose environment, then the Dockerfile's
HEALTHCHECK against the running API. No Docker engine needed; what differs from a container is
only what must (Redis address, data dir, bind address and port)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from harness import spawn, stop
from tests.support import REPO, free_port, wait_for_job, wait_until

pytestmark = pytest.mark.e2e

_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with nothing set: the default (as on a host without a .env)."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", str(value))


def compose_service(name: str) -> tuple[list[str], dict[str, str]]:
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    service = services[name]
    env = {key: _interpolate(value) for key, value in service.get("environment", {}).items()}
    return list(service["command"]), env


def dockerfile_env_and_healthcheck() -> tuple[dict[str, str], list[str]]:
    text = (REPO / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(dict(re.findall(r"(\w+)=(\S+)", line)))
    health = re.search(r"^HEALTHCHECK .*?\bCMD\s+(\[.*\])\s*$", text, re.MULTILINE)
    assert health, "docker/Dockerfile has no exec-form HEALTHCHECK CMD"
    return env, json.loads(health.group(1))


def as_local(argv: list[str]) -> list[str]:
    """The image's executables, from this venv."""
    tools = {"torchyard": str(Path(sys.executable).parent / "torchyard"), "python": sys.executable}
    return [tools.get(argv[0], argv[0]), *argv[1:]]


def test_compose_api_and_cpu_worker_commands_run_a_job(clean_redis_url: str, tmp_path: Path) -> None:
    image_env, healthcheck = dockerfile_env_and_healthcheck()
    port = free_port()
    # Compose requires TORCHYARD_API_KEY (`${TORCHYARD_API_KEY:?...}`): a .env would set it.
    local = {"TORCHYARD_REDIS_URL": clean_redis_url, "TORCHYARD_DATA_DIR": str(tmp_path / "data"),
             "TORCHYARD_HOST": "127.0.0.1", "TORCHYARD_PORT": str(port), "PYTHONUNBUFFERED": "1",
             "TORCHYARD_API_KEY": "entrypoint-test-key"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    procs: list[subprocess.Popen] = []
    logs: dict[str, Path] = {}
    try:
        for service in ("worker-cpu", "api"):
            command, compose_env = compose_service(service)
            assert command[0] == "torchyard", command
            env = {**base, **image_env, **compose_env, **local}
            assert env["TORCHYARD_REDIS_URL"] == clean_redis_url
            logs[service] = tmp_path / f"{service}.log"
            # cwd outside the repository, like the image's WORKDIR: the installed package runs.
            procs.append(spawn(as_local(command), logs[service], env, cwd=tmp_path))

        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                              headers={"Authorization": "Bearer entrypoint-test-key"})
        try:
            wait_until(lambda: client.get("/readyz").status_code == 200, timeout=90, what="API + worker ready")
            [device] = client.get("/devices").json()["devices"]
            node = compose_service("worker-cpu")[1]["TORCHYARD_NODE_NAME"]
            assert device["id"] == f"{node}/cpu" and device["status"] == "idle"

            created = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1})
            assert created.status_code == 202, created.text
            job = wait_for_job(client, created.json()["id"], {"succeeded", "failed"}, timeout=180)
            assert job["status"] == "succeeded", job["error"]
            assert job["device"] == f"{node}/cpu" and job["checkpoint"]["bytes"] > 0
        finally:
            client.close()

        # The image's HEALTHCHECK, verbatim, against the running API (it reads TORCHYARD_PORT).
        check = subprocess.run(as_local(healthcheck), env={**base, **image_env, **local}, cwd=tmp_path,
                               capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            stop(proc, None, grace=60)
    # SIGTERM stops both cleanly. uvicorn re-raises the signal after its graceful shutdown, so the
    # API ends "killed by SIGTERM" (exit 143 in a container), after it says it shut down.
    worker, api = procs
    assert worker.returncode == 0, f"worker exited {worker.returncode}:\n{logs['worker-cpu'].read_text()[-3000:]}"
    assert api.returncode in (0, -signal.SIGTERM), api.returncode
    assert "Application shutdown complete" in logs["api"].read_text()


def test_healthcheck_fails_without_an_api(tmp_path: Path) -> None:
    """The HEALTHCHECK can fail: nothing listening on its port → non-zero."""
    image_env, healthcheck = dockerfile_env_and_healthcheck()
    env = {**os.environ, **image_env, "TORCHYARD_PORT": str(free_port())}
    check = subprocess.run(as_local(healthcheck), env=env, cwd=tmp_path, capture_output=True, timeout=30)
    assert check.returncode != 0
