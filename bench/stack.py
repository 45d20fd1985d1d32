"""The torchyard service as bench/train.py runs it: embedded Redis, one CPU worker and the API,
started one by one as real processes (the harness's `Processes`), stopped whatever happens.
A host as a user runs it, `torchyard up`, is the harness's `UpStack` (bench/photos.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import Processes, free_port, wait_for_job, wait_until

JOB_TIMEOUT_S = 3600


class Service:
    """The service as real processes: embedded Redis, one CPU worker, the API, every setting at its
    default (none of the tests' faster heartbeats), with `threads` torch threads in the worker."""

    def __init__(self, data_dir: Path, logs: Path, threads: int | None) -> None:
        self.data_dir, self.logs, self.threads = data_dir, logs, threads

    def __enter__(self) -> Service:
        import httpx

        from app.embedded_redis import EmbeddedRedis

        self.redis = EmbeddedRedis(self.data_dir / "redis")
        self.redis.start()
        env = {"TORCHYARD_VERIFY_BUILTIN_CHECKSUMS": "false"}
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)  # the worker's torch intra-op threads
        self.procs = Processes(self.redis.url, self.data_dir, self.logs, defaults={}, **env)
        port = free_port()
        self.procs.worker("cpu", name="worker", TORCHYARD_PORT=str(port))
        self.procs.api(port)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        try:
            wait_until(lambda: self.client.get("/readyz").status_code == 200, timeout=120, what="the service")
        except BaseException:
            self.__exit__()
            raise
        return self

    def job(self, spec: dict[str, Any]) -> list[float]:
        """Submit a job over HTTP, wait for it; the worker's images/s per epoch."""
        created = self.client.post("/jobs", json=spec)
        created.raise_for_status()
        job = wait_for_job(self.client, created.json()["id"], {"succeeded", "failed", "cancelled"},
                           timeout=JOB_TIMEOUT_S, interval=0.5)
        if job["status"] != "succeeded":
            raise RuntimeError(f"benchmark job {job['status']}: {job['error']}")
        return [m["images_per_second"] for m in job["metrics"]]

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.procs.stop_all()
        self.redis.stop()

