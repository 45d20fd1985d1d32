"""The stack as processes: torchyard's processes on one Redis (`Processes`), or a host as a user
runs it (`UpStack`, `torchyard up`). Each is stopped whatever happens, nothing left running."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

from harness.processes import cli, free_port, kill_group, spawn, stop, wait_until, without_settings

# What a test's processes run with unless it says otherwise: heartbeats fast enough for a test to
# see a worker go, and one API process, so the per-process connection caps the security tests
# count on do not depend on the machine's cores.
TEST_SETTINGS = {"TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5", "TORCHYARD_HEARTBEAT_TTL_S": "3", "TORCHYARD_API_WORKERS": "1"}


def with_db(url: str, db: int) -> str:
    """`url` naming Redis database `db` instead (TCP or unix socket)."""
    parsed = urlparse(url)
    if parsed.scheme == "unix":
        return f"unix://{parsed.path}?db={db}"
    return urlunparse(parsed._replace(path=f"/{db}"))


def wait_for_job(client: Any, job_id: str, statuses: set[str], timeout: float = 120.0, interval: float = 0.2) -> dict:
    """The job's record (over HTTP, `client` an httpx.Client) once its status is one of `statuses`."""
    def done() -> dict | None:
        job = client.get(f"/jobs/{job_id}").json()
        return job if job["status"] in statuses else None

    return wait_until(done, timeout=timeout, interval=interval, what=f"job {job_id} to reach {statuses}")


class Processes:
    """torchyard processes (`worker`, `api`) on one Redis and data dir, with a shared environment
    (ours, less the API key, plus `defaults` and `env`), each logging to `<logs>/<name>.log`;
    `stop_all` stops them in the reverse order of their start."""

    def __init__(self, redis_url: str, data_dir: Path, logs: Path, *, defaults: dict[str, str] | None = None,
                 **env: str) -> None:
        self.env = {**os.environ, "TORCHYARD_REDIS_URL": redis_url, "TORCHYARD_DATA_DIR": str(data_dir),
                    "PYTHONUNBUFFERED": "1", **(TEST_SETTINGS if defaults is None else defaults)}
        self.env.pop("TORCHYARD_API_KEY", None)
        self.env.update(env)
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, *args: str, **env: str) -> subprocess.Popen:
        """`python -m app.cli <args>` with the shared environment and `env`, logging to `<name>.log`."""
        proc = spawn(cli(*args), self.logs / f"{name}.log", {**self.env, **env})
        proc.log_path = self.logs / f"{name}.log"  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def worker(self, device: str = "cpu", name: str | None = None, **env: str) -> subprocess.Popen:
        return self.spawn(name or f"worker-{device}", "worker", "--device", device, **env)

    def api(self, port: int, **env: str) -> subprocess.Popen:
        return self.spawn("api", "api", TORCHYARD_PORT=str(port), **env)

    def ready_api(self, **env: str) -> str:
        """An API process on a free port, answering /healthz; returns its base URL."""
        import httpx

        port = free_port()
        self.api(port, **env)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, timeout=60, what="the API")
        return base

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """`sig` to `proc` alone (a test's fault reaches that process only), its whole group killed
        past `timeout`; its exit status."""
        return stop(proc, sig, timeout)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)

    def log(self, proc: subprocess.Popen) -> str:
        return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


class UpStack:
    """`torchyard up` (embedded Redis, the API, one worker per device) on `data_dir`, on a free port,
    with `env` on top of ours (no TORCHYARD_ variable of ours leaks in), ready once /readyz answers.
    `up` stops its children in order on SIGTERM, and they die with it however it dies (a
    parent-death signal); whatever is still alive after that is killed by pid."""

    def __init__(self, data_dir: Path, log_path: Path, env: dict[str, str] | None = None,
                 start_timeout: float = 240, port: int | None = None, client_timeout: float = 120) -> None:
        self.data_dir, self.log_path, self.start_timeout = data_dir, log_path, start_timeout
        self.port = port or free_port()
        self.client_timeout = client_timeout
        self.env = {**without_settings(), "TORCHYARD_DATA_DIR": str(data_dir), "TORCHYARD_PORT": str(self.port),
                    "TORCHYARD_HOST": "127.0.0.1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.children: list[Any] = []  # psutil.Process, once ready

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> UpStack:
        import httpx
        import psutil

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = spawn(cli("up"), self.log_path, self.env)
        self.client = httpx.Client(base_url=self.url, timeout=self.client_timeout)
        try:
            def ready() -> bool:
                if self.proc is not None and self.proc.poll() is not None:
                    raise SystemExit(f"`torchyard up` exited with {self.proc.returncode}; see {self.log_path}")
                return self.client.get("/readyz").status_code == 200

            wait_until(ready, timeout=self.start_timeout, interval=0.3, what="`torchyard up`")
            self.children = psutil.Process(self.proc.pid).children(recursive=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def close_connections(self) -> None:
        """Close the control client's keep-alive connections: a load of as many clients as the API
        allows from one address (TORCHYARD_MAX_CONNECTIONS_PER_CLIENT) leaves no room for it."""
        import httpx

        self.client.close()
        self.client = httpx.Client(base_url=self.url, timeout=self.client_timeout)

    def descendants(self) -> list[Any]:
        """`up`'s processes now (psutil.Process): Redis, the API and its children, the workers."""
        import psutil

        assert self.proc is not None
        return psutil.Process(self.proc.pid).children(recursive=True)

    def pids(self) -> dict[str, int]:
        """The stack's processes by role: api (uvicorn's supervisor, its children counted with it),
        worker, redis."""
        roles: dict[str, int] = {}
        for child in self.children:
            try:
                line = " ".join(child.cmdline())
            except Exception:  # gone already
                continue
            if "redis-server" in line:
                roles.setdefault("redis", child.pid)
            elif "app.cli worker" in line:
                roles.setdefault("worker", child.pid)
            elif "app.cli api" in line:
                roles.setdefault("api", child.pid)
        return roles

    def __exit__(self, *exc: object) -> None:
        import psutil

        if getattr(self, "client", None) is not None:
            self.client.close()
        if self.proc is None:
            return
        known = list(self.children)
        try:
            known = psutil.Process(self.proc.pid).children(recursive=True) or known
        except psutil.Error:
            pass
        stop(self.proc, grace=90)  # `up` stops its children in order, Redis last
        kill_group(self.proc.pid)
        for child in known:  # each in a session of its own: not in up's group
            try:
                child.kill()
            except psutil.Error:
                pass
        self.proc = None
