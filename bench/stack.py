"""The torchyard service as a bench runs it: real processes, stopped by group whatever happens.

`Service` is embedded Redis + one CPU worker + the API started one by one (bench/train.py);
`UpStack` is `python -m app.cli up` on a data dir of its own, the way a user runs one host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness import REPO, kill_group, spawn

JOB_TIMEOUT_S = 3600


class Service:
    """The service as real processes: embedded Redis, one CPU worker, the API."""

    def __init__(self, data_dir: Path, logs: Path, threads: int | None) -> None:
        self.data_dir, self.logs, self.threads = data_dir, logs, threads
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Service:
        import httpx

        from app.embedded_redis import EmbeddedRedis
        from tests.support import free_port, wait_until

        self.redis = EmbeddedRedis(self.data_dir / "redis")
        self.redis.start()
        env = {**os.environ, "TORCHYARD_REDIS_URL": self.redis.url, "TORCHYARD_DATA_DIR": str(self.data_dir),
               "TORCHYARD_VERIFY_BUILTIN_CHECKSUMS": "false", "PYTHONUNBUFFERED": "1"}
        env.pop("TORCHYARD_API_KEY", None)
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)  # the worker's torch intra-op threads
        port = free_port()
        self.logs.mkdir(parents=True, exist_ok=True)
        for name, args in (("worker", ["worker", "--device", "cpu"]), ("api", ["api"])):
            log = open(self.logs / f"{name}.log", "ab")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "app.cli", *args], cwd=REPO,
                                               env={**env, "TORCHYARD_PORT": str(port)}, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        try:
            wait_until(lambda: self.client.get("/readyz").status_code == 200, timeout=120, what="the service")
        except BaseException:
            self.__exit__()
            raise
        return self

    def job(self, spec: dict[str, Any]) -> list[float]:
        """Submit a job over HTTP, wait for it; the worker's images/s per epoch."""
        from tests.support import wait_until

        created = self.client.post("/jobs", json=spec)
        created.raise_for_status()
        job_id = created.json()["id"]

        def finished():
            job = self.client.get(f"/jobs/{job_id}").json()
            return job if job["status"] in ("succeeded", "failed", "cancelled") else None

        job = wait_until(finished, timeout=JOB_TIMEOUT_S, interval=0.5, what="the benchmark job")
        if job["status"] != "succeeded":
            raise RuntimeError(f"benchmark job {job['status']}: {job['error']}")
        return [m["images_per_second"] for m in job["metrics"]]

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self.redis.stop()


class UpStack:
    """`python -m app.cli up` (embedded Redis, the API, one worker per device) on `data_dir`, on a
    free port, with `env` on top of ours (no TORCHYARD_ variable of ours leaks in). `up` stops its
    children in order on SIGTERM, and they die with it however it dies (a parent-death signal);
    whatever is still alive after that is killed by pid."""

    def __init__(self, data_dir: Path, log_path: Path, env: dict[str, str] | None = None,
                 start_timeout: float = 240) -> None:
        from tests.support import free_port

        self.data_dir, self.log_path, self.start_timeout = data_dir, log_path, start_timeout
        self.port = free_port()
        base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        self.env = {**base, "TORCHYARD_DATA_DIR": str(data_dir), "TORCHYARD_PORT": str(self.port),
                    "TORCHYARD_HOST": "127.0.0.1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.children: list[Any] = []  # psutil.Process, once ready

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> UpStack:
        import httpx
        import psutil

        from tests.support import wait_until

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = spawn(["-m", "app.cli", "up"], self.log_path, self.env)
        self.client = httpx.Client(base_url=self.url, timeout=120)
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
        self.client = httpx.Client(base_url=self.url, timeout=120)

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `up` stops its children in order, Redis last
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc, grace=1)
        for child in known:  # each in a session of its own: not in up's group
            try:
                child.kill()
            except psutil.Error:
                pass
        self.proc = None
