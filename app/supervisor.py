"""`torchyard up`: Redis (embedded unless configured), the API, and one worker per device.

Children run in their own sessions so a terminal's Ctrl-C reaches only us, and we stop them in
order: workers and API first (workers requeue their jobs, which needs Redis), Redis last.
A child that dies is restarted with exponential backoff; each child also gets a parent-death
signal, so even a SIGKILLed supervisor leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from app.core.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.process import die_with_parent

log = logging.getLogger("torchyard.supervisor")

BACKOFF_MAX_S = 30.0
HEALTHY_AFTER_S = 60.0
STOP_GRACE_S = 60.0


def visible_gpus(settings: Settings) -> list[str]:
    """GPU indices for `up`, without initialising CUDA here (we start CUDA processes)."""
    if settings.devices == "cpu":
        return []
    if settings.devices != "auto":
        return [d.strip() for d in settings.devices.split(",") if d.strip()]
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    if outer is not None:
        return [d.strip() for d in outer.split(",") if d.strip() and d.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip().isdigit()]


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0
    backoff_s: float = field(default=1.0)

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env=self.env, preexec_fn=die_with_parent, start_new_session=True)
        self.started_at = time.monotonic()
        log.info("started %s (pid %d): %s", self.name, self.process.pid, " ".join(self.argv[1:]))


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.stopping = threading.Event()
        self.redis: EmbeddedRedis | None = None
        self.children: list[Child] = []

    def plan(self, redis_url: str) -> list[Child]:
        base = {**os.environ, "TORCHYARD_REDIS_URL": redis_url, "TORCHYARD_DATA_DIR": str(self.settings.data_dir),
                "PYTHONUNBUFFERED": "1"}
        cli = [sys.executable, "-m", "app.cli"]
        children = [Child("api", [*cli, "api"], base)]
        gpus = visible_gpus(self.settings)
        for index in gpus:
            env = {**base, "CUDA_VISIBLE_DEVICES": index, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            children.append(Child(f"worker-gpu{index}", [*cli, "worker", "--device", "0"], env))
        if not gpus:
            children.append(Child("worker-cpu", [*cli, "worker", "--device", "cpu"],
                                  {**base, "CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))
        return children

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _frame: self._request_stop(signum))
        try:
            redis_url = self.settings.redis_url
            if not redis_url:
                self.redis = EmbeddedRedis(self.settings.embedded_redis_dir)
                redis_url = self.redis.start()
            self.children = self.plan(redis_url)
            for child in self.children:
                child.start()
            log.info("torchyard is up: API on http://%s:%d, %d worker(s); Ctrl-C stops everything",
                     self.settings.host, self.settings.port, len(self.children) - 1)
            while not self.stopping.wait(0.5):
                self._watch()
        finally:
            self._shutdown()
        return 0

    def _request_stop(self, signum: int) -> None:
        if not self.stopping.is_set():
            log.info("received %s: stopping", signal.Signals(signum).name)
        self.stopping.set()

    def _watch(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.process is not None and child.process.poll() is not None:
                code = child.process.returncode
                if now - child.started_at >= HEALTHY_AFTER_S:
                    child.backoff_s = 1.0
                child.next_start = now + child.backoff_s
                log.warning("%s exited with code %s; restarting in %.0fs", child.name, code, child.backoff_s)
                child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)
                child.process = None
            if child.process is None and now >= child.next_start:
                child.restarts += 1
                log.warning("restarting %s (restart #%d)", child.name, child.restarts)
                child.start()

    def _shutdown(self) -> None:
        running = [c for c in self.children if c.process is not None and c.process.poll() is None]
        for child in running:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in running:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", child.name)
                child.process.kill()
                child.process.wait()
        if self.redis is not None:
            self.redis.stop()
        log.info("stopped")
