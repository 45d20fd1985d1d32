"""A real MLflow tracking server for the tests and the benchmark: `mlflow server` with a SQLite
backend store and a local artifacts destination under `root`, on a free port of loopback, proxying
artifacts (what a torchyard worker writes through its client, a test reads back through its own).

Slow to start (about 15 s on a fresh database: its migrations; about 7 s on an existing one), so a
test module starts one and keeps it. `kill` (SIGKILL to its whole group: the gunicorn/uvicorn
parent and its worker) and `start` again on the same store and port are the fault a test injects:
the runs it held are still there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.processes import end_group, free_port, kill_group, spawn, wait_http


class MlflowServer:
    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> MlflowServer:
        mlflow = Path(sys.executable).with_name("mlflow")
        self.proc = spawn([str(mlflow), "server", "--backend-store-uri", f"sqlite:///{self.root / 'db.sqlite'}",
                           "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
                           "--port", str(self.port), "--workers", "1"], self.root / "server.log")
        wait_http(self.port, "/health", timeout=timeout, proc=self.proc)
        return self

    def kill(self) -> None:
        """SIGKILL to the server and its workers, as a crash would."""
        if self.proc is not None:
            kill_group(self.proc.pid)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            end_group(self.proc, grace=10)
        elif self.proc is not None:
            kill_group(self.proc.pid)
