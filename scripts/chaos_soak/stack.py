"""The stack the soak breaks, on loopback in a data dir of its own: `torchyard up` (its embedded
Redis, the API, worker `chaos-a`) and a second worker "host" `chaos-b` on the same Redis and data
dir, restarted when it dies as compose's restart policy would. It finds the processes a fault
targets, signals them, and says when the stack is whole again (`ready`)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from harness import cli, free_port, spawn, stop, without_settings

from . import log


def ready(client: httpx.Client, both_workers: bool = True, gone: frozenset[int] = frozenset()) -> bool:
    """The whole stack is back: the API answers /readyz and both workers are serving, from
    processes other than those in `gone` (a killed or broken worker's last heartbeat lingers)."""
    try:
        if client.get("/readyz", timeout=3).status_code != 200:
            return False
        if not both_workers:
            return True
        devices = client.get("/devices", timeout=3).json()["devices"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    serving = {d["id"] for d in devices if d["status"] in ("idle", "busy") and d.get("pid") not in gone}
    return {"chaos-a/cpu", "chaos-b/cpu"} <= serving


def wait_ready(client: httpx.Client, timeout: float, both_workers: bool = True,
               gone: frozenset[int] = frozenset()) -> float | None:
    """When (time.monotonic) the stack was whole again, or None after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready(client, both_workers, gone):
            return time.monotonic()
        time.sleep(0.2)
    return None


class Stack:
    """`torchyard up` (Redis, API, worker chaos-a) and the second host's worker chaos-b."""

    def __init__(self, data_dir: Path, lease_ttl_s: float) -> None:
        from app.embedded_redis import EmbeddedRedis  # only to name the socket `up` will use

        self.data_dir = data_dir
        self.logs = data_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.redis_url = EmbeddedRedis(data_dir / "redis").url
        self.fault_files = {"chaos-a": data_dir / "fault-chaos-a", "chaos-b": data_dir / "fault-chaos-b"}
        self.env = {**without_settings(), "TORCHYARD_DATA_DIR": str(data_dir), "TORCHYARD_HOST": "127.0.0.1",
                    "TORCHYARD_PORT": str(self.port), "TORCHYARD_DEVICES": "cpu", "PYTHONUNBUFFERED": "1",
                    "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5", "TORCHYARD_HEARTBEAT_TTL_S": "3",
                    "TORCHYARD_LEASE_TTL_S": str(lease_ttl_s), "TORCHYARD_MAX_ATTEMPTS": "1000",
                    "TORCHYARD_ADVERTISE_ADDRESS": "127.0.0.1",  # a gang's rendezvous, on loopback too
                    "TORCHYARD_PREDICT_CPU_THREADS": "1"}
        self.up: subprocess.Popen | None = None
        self.worker_b: subprocess.Popen | None = None
        self.frozen: set[int] = set()
        # Every process of the stack is started by this one thread, which lives until `stop`: the
        # parent-death signal (harness/processes.py, `dies_with_parent`) is armed for the *thread*
        # that forks, so a worker started by a thread that then ended (the fault loop, the soak's
        # supervisor once the faults stop) would get SIGTERM from the kernel while it starts.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="chaos-spawner")
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._restart = threading.Lock()  # the supervisor, the fault loop and the end of the run restart it

    def _spawn(self, argv: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
        return self._spawner.submit(spawn, argv, self.logs / log_name, env, dies_with_parent=True).result()

    def start(self) -> None:
        env = {**self.env, "TORCHYARD_NODE_NAME": "chaos-a", "TORCHYARD_DEVICE_FAULT_FILE": str(self.fault_files["chaos-a"])}
        self.up = self._spawn(cli("up"), env, "up.log")

    def start_worker_b(self) -> None:
        env = {**self.env, "TORCHYARD_NODE_NAME": "chaos-b", "TORCHYARD_REDIS_URL": self.redis_url,
               "TORCHYARD_DEVICE_FAULT_FILE": str(self.fault_files["chaos-b"])}
        self.worker_b = self._spawn(cli("worker", "--device", "cpu"), env, "worker-b.log")

    def supervise_worker_b(self) -> None:
        """The second host's supervisor, until the stack stops (not when the faults stop: the last
        fault's recovery may still need a restart)."""
        def watch() -> None:
            while not self._stopping.wait(1.0):
                self.keep_worker_b()

        self._supervisor = threading.Thread(target=watch, daemon=True, name="worker-b-supervisor")
        self._supervisor.start()

    def wait_for_redis(self, timeout: float) -> bool:
        import redis

        client = redis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    if client.ping():
                        return True
                except (redis.RedisError, OSError):
                    time.sleep(0.2)
            return False
        finally:
            client.close()

    def keep_worker_b(self) -> None:
        """The second host's supervisor: start chaos-b again when it died."""
        with self._restart:
            if self.worker_b is not None and self.worker_b.poll() is not None:
                log(f"worker chaos-b exited with {self.worker_b.returncode}; restarting it")
                self.start_worker_b()

    def processes(self) -> dict[str, psutil.Process]:
        """The live targets: redis, api, worker-a (children of `up`), worker-b."""
        found: dict[str, psutil.Process] = {}
        if self.up is not None and self.up.poll() is None:
            for child in psutil.Process(self.up.pid).children():
                try:
                    line = " ".join(child.cmdline())
                except psutil.Error:
                    continue
                if "redis-server" in line:
                    found["redis"] = child
                elif " api" in line:
                    found["api"] = child
                elif " worker" in line:
                    found["worker-a"] = child
        if self.worker_b is not None and self.worker_b.poll() is None:
            found["worker-b"] = psutil.Process(self.worker_b.pid)
        return found

    def signal(self, proc: psutil.Process, sig: int) -> None:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            return
        if sig == signal.SIGSTOP:
            self.frozen.add(proc.pid)
        elif sig == signal.SIGCONT:
            self.frozen.discard(proc.pid)

    def thaw_all(self) -> None:
        for pid in list(self.frozen):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.frozen.clear()

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        self.thaw_all()
        for proc in (self.worker_b, self.up):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # both at once: `up` stops its own children in order
        for proc in (self.worker_b, self.up):
            if proc is not None:
                stop(proc, None, grace=90)
        self._spawner.shutdown()

