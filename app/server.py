"""How the API process serves: uvicorn's options, the connection guard, and the safe default.

What uvicorn (0.54, httptools) leaves open, as tried against a bare uvicorn app:
- no time limit on a request's head: `timeout_keep_alive` runs only between requests and any byte
  resets it, so a client that connects and trickles a header line (slowloris) holds a connection
  for ever (uvicorn issue #157: `--timeout-request-start` was never implemented);
- no limit on the head's size with httptools: header lines grow the process by as much as is sent
  (h11's `h11_max_incomplete_event_size` does not apply to httptools);
- `limit_concurrency` answers its 503 as text/plain, after the head has been read.
`GuardedHttpProtocol` adds, per connection: the head must be complete within `header_timeout_s`
of the connection (or of the previous response) and within `max_header_bytes` (408 / 431, then
closed); at most `max_connections` open connections per process and `max_connections_per_client`
per client address (503 with a JSON `detail`, then closed). The body's own deadline and cap are
the front gate's (app/api/front.py), which sees the route.

Several processes on one port (`serve`, TORCHYARD_API_WORKERS > 1): a /predict costs one uvicorn
process enough CPU that a single process, on one core, serves far fewer requests than a GPU
classifies images (docs/benchmarks.md has the CPU per request). uvicorn's own
supervisor (`uvicorn.supervisors.Multiprocess`, subclassed as `ApiProcesses`) binds the socket
once and spawns N children that accept on it; it restarts a child that dies or stops answering
its pings, and on SIGTERM/SIGINT stops them all (each drains for `timeout_graceful_shutdown`)
before it exits. A spawned child starts from an import string, so it builds its app and its
connection limits from its own Settings (`api_process_app`: the same environment, hence the
same values). The parent gives the children a fresh private directory for prometheus_client's
multiprocess mode (app/api/metrics.py) and removes it when they are gone. The limits above are
per process: N processes hold up to N x TORCHYARD_MAX_CONNECTIONS connections.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from socket import socket
from typing import TYPE_CHECKING, Any, ClassVar, cast

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.supervisors.multiprocess import Multiprocess

from app.corked import CorkedTransport
from app.process import die_with_parent
from core.config import Settings, get_settings

if TYPE_CHECKING:
    import asyncio

    from fastapi import FastAPI

log = logging.getLogger("torchyard.api")


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    max_header_bytes: int
    max_connections: int
    max_connections_per_client: int  # 0: no limit

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        return cls(settings.header_timeout_s, settings.max_header_bytes, settings.max_connections,
                   settings.max_connections_per_client)


def _raw_response(status: int, reason: str, detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def _refusing_app(status: int, detail: str) -> Any:
    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        body = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    return refuse


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size cap on each request head, and caps on
    open connections (see the module docstring). One instance per connection, all on one loop."""

    limits: ClassVar[ConnectionLimits | None] = None  # set by `configure`; else read from the environment
    _per_client: ClassVar[collections.Counter[str]] = collections.Counter()

    @classmethod
    def configure(cls, settings: Settings) -> None:
        cls.limits = ConnectionLimits.from_settings(settings)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if GuardedHttpProtocol.limits is None:  # served by something other than `serve` (it configures it)
            GuardedHttpProtocol.limits = ConnectionLimits.from_settings(get_settings())
        self._limits = GuardedHttpProtocol.limits
        self._peer: str | None = None
        self._awaiting_head = True
        self._head_bytes = 0  # bytes received while the head is incomplete
        self._head_size = 0  # the head's exact size, as the parser reports its parts
        self._head_timer: Any = None

    # -------------------------------------------------------------- connection
    def connection_made(self, transport: Any) -> None:
        # A response in one write (app/corked.py); it delegates what it does not hold to the transport.
        super().connection_made(cast("asyncio.Transport", CorkedTransport(transport, self.loop)))
        peer = self.client[0] if self.client else None
        if len(self.connections) > self._limits.max_connections:
            self._refuse(503, "Service Unavailable", f"the server has {self._limits.max_connections} connections "
                                                     f"open, its limit (TORCHYARD_MAX_CONNECTIONS); retry shortly")
            return
        per_client = self._limits.max_connections_per_client
        if peer is not None and per_client and self._per_client[peer] >= per_client:
            self._refuse(503, "Service Unavailable", f"{per_client} connections from your address are open, the "
                                                     f"limit (TORCHYARD_MAX_CONNECTIONS_PER_CLIENT); close some")
            return
        if peer is not None:
            self._peer = peer
            self._per_client[peer] += 1
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self._peer is not None:
            self._per_client[self._peer] -= 1
            if self._per_client[self._peer] <= 0:
                del self._per_client[self._peer]
            self._peer = None
        super().connection_lost(exc)

    # -------------------------------------------------------------- request head
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._awaiting_head and not self.transport.is_closing():
            # A head still incomplete after this many bytes is refused here, so the parser never
            # buffers more than the cap plus one read (a chunk that completes the head and carries
            # body bytes is not counted: `on_headers_complete` judges the head's exact size).
            self._head_bytes += len(data)
            if self._head_bytes > self._limits.max_header_bytes:
                self._refuse(431, "Request Header Fields Too Large", self._head_too_large)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._head_size += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._disarm_head_timer()
        if self._head_size <= self._limits.max_header_bytes:
            super().on_headers_complete()
            return
        # A complete but oversized head: uvicorn runs this request's cycle with an app that
        # answers 431 and closes, instead of ours (as it does for its own concurrency limit).
        app, self.app = self.app, _refusing_app(431, self._head_too_large)
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    @property
    def _head_too_large(self) -> str:
        return f"the request head is over {self._limits.max_header_bytes} bytes (TORCHYARD_MAX_HEADER_BYTES)"

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self._arm_head_timer()  # the next request on this connection gets its own deadline

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._awaiting_head = True
        self._head_bytes = self._head_size = 0
        self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._awaiting_head and not self.transport.is_closing():
            self._refuse(408, "Request Timeout", f"the request head did not arrive within "
                                                 f"{self._limits.header_timeout_s:g} s (TORCHYARD_HEADER_TIMEOUT_S)")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser rejects, as JSON with a `detail` like every other."""
        self._refuse(400, "Bad Request", f"malformed HTTP request: {msg}")

    def _refuse(self, status: int, reason: str, detail: str) -> None:
        self._disarm_head_timer()
        self._awaiting_head = False
        if not self.transport.is_closing():
            self.transport.write(_raw_response(status, reason, detail))
            self.transport.close()


def unsafe_bind_refusal(settings: Settings) -> str | None:
    """Why this API must not start as configured: no key, or no Host names (the DNS-rebinding
    guard, app/api/front.HostCheck), on an address others can reach."""
    if settings.binds_loopback:
        return None
    if (settings.api_key is not None or settings.allow_unauthenticated) and not settings.allowed_host_names:
        return (f"refusing to serve on {settings.host}:{settings.port} without TORCHYARD_ALLOWED_HOSTS: set it to the "
                f"names clients use for this server (e.g. torchyard.internal,10.0.0.5), or to '*' to serve any Host "
                f"header (no DNS-rebinding guard)")
    if settings.api_key is not None or settings.allow_unauthenticated:
        return None
    return (f"refusing to serve on {settings.host}:{settings.port} without an API key: anyone who can reach this "
            f"address could train, upload and read checkpoints. Set TORCHYARD_API_KEY (clients send "
            f"`Authorization: Bearer <key>`), bind to 127.0.0.1, or set TORCHYARD_ALLOW_UNAUTHENTICATED=true "
            f"if something in front of torchyard authenticates")


def warn_if_open(settings: Settings) -> None:
    """Say it loudly when the operator chose to serve without a key beyond this host."""
    if settings.api_key is None and not settings.binds_loopback and settings.allow_unauthenticated:
        log.warning("!" * 78)
        log.warning("NO AUTHENTICATION: TORCHYARD_ALLOW_UNAUTHENTICATED=true and no TORCHYARD_API_KEY; the API on "
                    "%s:%d serves anyone who can reach it", settings.host, settings.port)
        log.warning("!" * 78)


def raise_open_files_limit(wanted: int) -> None:
    """Every connection is a file descriptor: lift the soft limit toward `wanted` (within the hard one)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        log.warning("could not raise the open-files limit to %d", wanted)


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of uvicorn.run / uvicorn.Config for the API."""
    GuardedHttpProtocol.configure(settings)
    raise_open_files_limit(settings.max_connections + 256)  # + Redis clients, files, the rest
    return {"host": settings.host, "port": settings.port, "log_level": "info", "access_log": settings.access_log,
            "timeout_graceful_shutdown": 5, "http": GuardedHttpProtocol, "timeout_keep_alive": 5,
            "ws": "none",  # no WebSocket routes: an Upgrade header is just a header
            "server_header": False}  # `server: uvicorn` tells a scanner what to try; nobody else reads it


# ------------------------------------------------------------------ several API processes
METRICS_DIR_PREFIX = "torchyard-api-metrics-"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # as app/api/metrics.py reads it (not imported: it loads prometheus)
EXIT_CHILD_FAILED_TO_START = 3  # uvicorn's STARTUP_FAILURE: `up` restarts the API with backoff


def serve(settings: Settings) -> int:
    """`torchyard api`: one uvicorn process, or `settings.api_workers` of them on one port."""
    import uvicorn

    # This process owns prometheus_client's variable (read once, when it is first imported, which
    # has not happened yet here): one inherited from elsewhere would point our counters at files
    # another program keeps, or at a directory that does not exist.
    os.environ.pop(MULTIPROC_ENV, None)
    options = uvicorn_options(settings)
    if settings.api_workers == 1:
        from app.main import create_app

        uvicorn.run(create_app(settings), **options)
        return 0
    with private_metrics_dir(Path(tempfile.gettempdir())) as metrics_dir:
        # Spawned children copy this environment, so they import prometheus_client in file mode.
        os.environ[MULTIPROC_ENV] = str(metrics_dir)
        config = Config(f"{__name__}:api_process_app", factory=True, workers=settings.api_workers, **options)
        sock = config.bind_socket()
        processes = ApiProcesses(config, [sock], metrics_dir)
        try:
            processes.run()
        finally:
            sock.close()
    return EXIT_CHILD_FAILED_TO_START if processes.child_failed_to_start else 0


def api_process_app() -> FastAPI:
    """The app of one spawned API process (uvicorn's factory, called in the child before it
    accepts a connection): its own Settings from the environment the parent passed down, its
    connection limits, and the parent-death signal: a SIGKILLed parent (OOM) must not leave
    children serving the port, or the restarted API could never bind it again."""
    die_with_parent()
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid != os.getppid():
        sys.exit(0)  # the parent died before the signal was armed
    from app.main import create_app
    from core.logs import configure_logging

    configure_logging()
    settings = get_settings()
    GuardedHttpProtocol.configure(settings)
    return create_app(settings)


class ApiProcesses(Multiprocess):
    """uvicorn's supervisor of the API processes, plus the metrics bookkeeping of a child that is
    gone (`mark_process_dead`: for counters and histograms it drops nothing, since a dead
    process's counts still count; it keeps live gauges right should one be added) and the
    exit status when a child could not start (uvicorn then stops them all)."""

    def __init__(self, config: Config, sockets: list[socket], metrics_dir: Path) -> None:
        super().__init__(config, sockets)
        self.metrics_dir = metrics_dir
        self.child_failed_to_start = False

    def _pids(self) -> set[int]:
        return {p.pid for p in self.processes if p.pid is not None}

    def _forget_gone(self, before: set[int]) -> None:
        from prometheus_client.multiprocess import mark_process_dead

        for pid in before - self._pids():
            mark_process_dead(pid, str(self.metrics_dir))

    def keep_subprocess_alive(self) -> None:
        before, stopping = self._pids(), self.should_exit.is_set()
        super().keep_subprocess_alive()
        if not stopping and self.should_exit.is_set():  # only a child's start-up failure sets it here
            self.child_failed_to_start = True
        self._forget_gone(before)

    def handle_signals(self) -> None:
        before = self._pids()
        super().handle_signals()  # SIGHUP replaces every child, SIGTTOU retires one
        self._forget_gone(before)


@contextlib.contextmanager
def private_metrics_dir(parent: Path) -> Iterator[Path]:
    """A fresh, empty directory for one API parent's metrics files, removed when it exits. Files
    left by an earlier run would be summed into this one's counters, so a new directory is made
    each time, and those of parents that are gone (SIGKILL: no chance to clean) are removed first."""
    remove_stale_metrics_dirs(parent)
    path = Path(tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_metrics_dirs(parent: Path) -> list[Path]:
    """Remove the metrics directories whose API parent no longer runs (or whose pid is ours: a
    restarted container reuses pids and keeps its /tmp). Returns what it removed."""
    removed = []
    for path in parent.glob(f"{METRICS_DIR_PREFIX}*"):
        pid_text = path.name[len(METRICS_DIR_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or not path.is_dir() or (int(pid_text) != os.getpid() and _alive(int(pid_text))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
