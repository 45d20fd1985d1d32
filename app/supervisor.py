"""`torchyard up`: Redis (embedded unless configured), the API, and one worker per device.

Children run in their own sessions so a terminal's Ctrl-C reaches only us, and we stop them in
order: workers and API first (workers requeue their jobs, which needs Redis), Redis last.
A child that dies is restarted with exponential backoff, the embedded Redis too (at once the
first time, on the same data: the API and workers reconnect by themselves); each child also gets
a parent-death signal, so even a SIGKILLed supervisor leaves nothing behind.

`up` holds an exclusive lock on its data dir (`DataDirLock`) for its whole life: a second `up`
on the same data dir refuses to start, instead of unlinking the first one's Redis socket and
starting a second Redis on the same append-only file. Before it starts anything it checks that the
API's port is free (a second `make run`: it says what holds the port and exits 2, with no Redis or
worker started). It says "torchyard is up" once /readyz answers 200 (a worker is ready), and a child that exits
with status 2 (EXIT_CONFIGURATION_ERROR: a setting, a port, a device held elsewhere) is not
restarted: `up` stops everything and exits 2, its message in the log above.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from app.embedded_redis import EmbeddedRedis
from app.ports import port_in_use
from app.process import EXIT_CONFIGURATION_ERROR, die_with_parent
from core.config import Settings

log = logging.getLogger("torchyard.supervisor")

BACKOFF_MAX_S = 30.0
HEALTHY_AFTER_S = 60.0
STOP_GRACE_S = 60.0
# Redis is restarted at once, then after 1, 2, 4, 5, 5 ... s while it keeps dying (its log says why).
REDIS_BACKOFF_MAX_S = 5.0
REDIS_START_TIMEOUT_S = 120.0  # a long append-only file takes a while to load
LOCK_FILE = "up.lock"
EXIT_DATA_DIR_IN_USE = EXIT_CONFIGURATION_ERROR
HEALTH_TIMEOUT_S = 0.5  # one /readyz probe of the API before the banner
NOT_READY_WARNING_S = 60.0  # the API answers but no worker is ready this long: said once


def _detail(refused: urllib.error.HTTPError) -> str:
    """The `detail` of an API error answer, else its status line."""
    try:
        return str(json.loads(refused.read())["detail"])
    except (ValueError, KeyError, TypeError, OSError):
        return f"{refused.code} {refused.reason}"


class DataDirInUse(RuntimeError):
    pass


class DataDirLock:
    """An exclusive `flock` on `<data dir>/up.lock`, held while `up` runs. The kernel drops it when
    the process dies, however it dies, so a stale lock never blocks a restart; the file holds the
    holder's pid for the message. Children do not inherit it (PEP 446 descriptors)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.path = data_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(f"data dir {self.data_dir.resolve()} is in use by another `torchyard up` "
                               f"(pid {holder}); stop it first, or give this one its own TORCHYARD_DATA_DIR") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


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
        self.lock = DataDirLock(settings.data_dir)
        self.redis_restarts = 0
        self._redis_started_at = 0.0
        self._redis_next_start = 0.0
        self._redis_backoff_s = 0.0
        self._announced = False
        self._api_answering_since = 0.0
        self._said_not_ready = False
        self.exit_code = 0

    def plan(self, redis_url: str) -> list[Child]:
        base = {**os.environ, "TORCHYARD_REDIS_URL": redis_url, "TORCHYARD_DATA_DIR": str(self.settings.data_dir),
                "PYTHONUNBUFFERED": "1"}
        if not self.settings.redis_url and not self.settings.advertise_address:
            # The embedded Redis is a unix socket: every worker is on this host, so a gang's ranks
            # reach each other on loopback, and rank 0's store listens nowhere else (docs/security.md).
            base["TORCHYARD_ADVERTISE_ADDRESS"] = "127.0.0.1"
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
        try:
            self.lock.acquire()
        except DataDirInUse as exc:
            log.error("%s", exc)
            return EXIT_DATA_DIR_IN_USE
        taken = port_in_use(self.settings.host, self.settings.port)
        if taken:
            log.error("%s; stop it, or start torchyard on another port (TORCHYARD_PORT=8001 make run)", taken)
            self.lock.release()
            return EXIT_CONFIGURATION_ERROR
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _frame: self._request_stop(signum))
        try:
            redis_url = self.settings.redis_url
            if not redis_url:
                self.redis = EmbeddedRedis(self.settings.embedded_redis_dir)
                redis_url = self.redis.start()
                self._redis_started_at = time.monotonic()
            self.children = self.plan(redis_url)
            for child in self.children:
                child.start()
            while not self.stopping.wait(0.5):
                self._watch()
                if not self._announced and not self.stopping.is_set():
                    self._announce_when_serving()
        finally:
            self._shutdown()
        return self.exit_code

    def _announce_when_serving(self) -> None:
        """The banner, once the stack is ready to work (/readyz: Redis answers and a worker's heartbeat
        is fresh), not merely once the API answers: a job or a prediction sent on the word "up" then
        finds a worker. Should the API answer but no worker get ready, that is said once, with why."""
        request = urllib.request.Request(f"{self.local_url}/readyz")
        if self.settings.api_key:
            request.add_header("Authorization", f"Bearer {self.settings.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=HEALTH_TIMEOUT_S) as answer:
                if answer.status != 200:
                    return
        except urllib.error.HTTPError as refused:  # the API answers: not ready yet, and why
            self._api_answering_since = self._api_answering_since or time.monotonic()
            if not self._said_not_ready and time.monotonic() - self._api_answering_since > NOT_READY_WARNING_S:
                self._said_not_ready = True
                log.warning("the API answers on %s but the stack is not ready after %.0f s: %s", self.local_url,
                            NOT_READY_WARNING_S, _detail(refused))
            return
        except OSError:
            return
        self._announced = True
        log.info("torchyard is up: API and dashboard on %s, %d worker(s) ready; the CLI: %s; Ctrl-C stops "
                 "everything", self.local_url, len(self.children) - 1, cli_hint(self.local_url))

    @property
    def local_url(self) -> str:
        """Where this host reaches the API (a wildcard bind is reached on loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.settings.host, self.settings.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.settings.port}"

    def _request_stop(self, signum: int) -> None:
        if not self.stopping.is_set():
            log.info("received %s: stopping", signal.Signals(signum).name)
        self.stopping.set()

    def _watch(self) -> None:
        now = time.monotonic()
        self._watch_redis(now)
        for child in self.children:
            if child.process is not None and child.process.poll() is not None:
                code = child.process.returncode
                if code == EXIT_CONFIGURATION_ERROR:
                    log.error("%s exited with code %d: it cannot run as configured (its message is above); "
                              "stopping everything", child.name, code)
                    child.process = None
                    self.exit_code = EXIT_CONFIGURATION_ERROR
                    self.stopping.set()
                    return
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

    def _watch_redis(self, now: float) -> None:
        """Restart the embedded Redis on the same data if it died (the others reconnect by themselves)."""
        server = self.redis
        if server is None or server.running:
            return
        if server.process is not None:
            code = server.process.returncode
            server.process = None
            if now - self._redis_started_at >= HEALTHY_AFTER_S:
                self._redis_backoff_s = 0.0
            self._redis_next_start = now + self._redis_backoff_s
            log.warning("embedded Redis exited with code %s; restarting it on the same data in %.0fs "
                        "(see %s)", code, self._redis_backoff_s, server.directory / "redis.log")
            self._redis_backoff_s = min(max(1.0, self._redis_backoff_s * 2), REDIS_BACKOFF_MAX_S)
        if now < self._redis_next_start:
            return
        try:
            server.start(timeout_s=REDIS_START_TIMEOUT_S)
        except RuntimeError as exc:
            log.error("embedded Redis did not come back: %s; trying again", exc)
            server.process = None
            self._redis_next_start = time.monotonic() + max(1.0, self._redis_backoff_s)
            return
        self.redis_restarts += 1
        self._redis_started_at = time.monotonic()
        log.warning("embedded Redis restarted (restart #%d)", self.redis_restarts)

    def _shutdown(self) -> None:
        running = [(c.name, c.process) for c in self.children if c.process is not None and c.process.poll() is None]
        for _, process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for name, process in running:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                process.kill()
                process.wait()
        if self.redis is not None:
            self.redis.stop()
        self.lock.release()
        log.info("stopped")


def cli_hint(url: str) -> str:
    """How to run the client from here: `torchyard` when it is on the PATH, else the console script
    beside this interpreter (`.venv/bin/torchyard` after `make run`), with --url when not the default."""
    script = Path(sys.executable).parent / "torchyard"
    if shutil.which("torchyard") == str(script) or (shutil.which("torchyard") and not script.exists()):
        command = "torchyard"
    elif script.exists():
        command = os.path.relpath(script) if script.is_relative_to(Path.cwd()) else str(script)
    else:
        command = f"{sys.executable} -m app.cli"
    return f"{command} devices" if url == "http://127.0.0.1:8000" else f"{command} --url {url} devices"
