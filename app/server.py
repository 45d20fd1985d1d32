"""How the API process serves: uvicorn's options, the connection guard, and the safe default.

What uvicorn (0.54, httptools) leaves open, measured here against a bare uvicorn app:
- no time limit on a request's head: `timeout_keep_alive` runs only between requests and any byte
  resets it, so a client that connects and trickles a header line (slowloris) holds a connection
  for ever (uvicorn issue #157: `--timeout-request-start` was never implemented);
- no limit on the head's size with httptools: 200 MiB of header lines grew the process by 200 MiB
  (h11's `h11_max_incomplete_event_size` does not apply to httptools);
- `limit_concurrency` answers its 503 as text/plain, after the head has been read.
`GuardedHttpProtocol` adds, per connection: the head must be complete within `header_timeout_s`
of the connection (or of the previous response) and within `max_header_bytes` (408 / 431, then
closed); at most `max_connections` open connections per process and `max_connections_per_client`
per client address (503 with a JSON `detail`, then closed). The body's own deadline and cap are
the front gate's (app/api/front.py), which sees the route.
"""

from __future__ import annotations

import collections
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from core.config import Settings, get_settings

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
        if GuardedHttpProtocol.limits is None:  # a uvicorn worker process spawned with these options
            GuardedHttpProtocol.limits = ConnectionLimits.from_settings(get_settings())
        self._limits = GuardedHttpProtocol.limits
        self._peer: str | None = None
        self._awaiting_head = True
        self._head_bytes = 0  # bytes received while the head is incomplete
        self._head_size = 0  # the head's exact size, as the parser reports its parts
        self._head_timer: Any = None

    # -------------------------------------------------------------- connection
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
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
    """Why this API must not start as configured: no key on an address others can reach."""
    if settings.api_key is not None or settings.binds_loopback or settings.allow_unauthenticated:
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
            "ws": "none"}  # no WebSocket routes: an Upgrade header is just a header
