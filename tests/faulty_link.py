"""A TCP link to a real Redis that a test can slow down or stall: the network between an API and
its Redis, with the faults a real one has. Every byte is passed on unchanged; the link only delays.

- `rate`: bytes per second towards Redis (a slow or congested link): a large value takes as long
  to arrive as its size needs.
- `count(marker)`: `marked` counts the times `marker` went to Redis, on any connection.
- `hold_replies_after(marker)`: the same, and once a connection has carried the marker, Redis's
  replies on it are held back until `release()` (a reply lost in a stalled network, or a Redis
  that ran the command and then stalled): the command ran, and its caller cannot know.
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlparse

CHUNK = 64 * 1024


class FaultyLink:
    def __init__(self, redis_url: str, rate: float | None = None) -> None:
        parsed = urlparse(redis_url)
        self.unix_path = parsed.path if parsed.scheme == "unix" else None
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 6379)
        self.rate = rate
        self.marker: bytes | None = None
        self.marked = 0
        self.holding = False
        self.released = threading.Event()
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def count(self, marker: bytes) -> None:
        self.marker, self.marked = marker, 0

    def hold_replies_after(self, marker: bytes) -> None:
        self.released.clear()
        self.holding = True
        self.count(marker)

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.release()
        self._server.close()
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self.unix_path is not None:
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                upstream.connect(self.unix_path)
            else:
                upstream = socket.create_connection(self.upstream)
            self._sockets += [client, upstream]
            held = threading.Event()
            threading.Thread(target=self._to_redis, args=(client, upstream, held), daemon=True).start()
            threading.Thread(target=self._to_client, args=(upstream, client, held), daemon=True).start()

    def _to_redis(self, source: socket.socket, sink: socket.socket, held: threading.Event) -> None:
        tail = b""
        try:
            while data := source.recv(CHUNK):
                marker = self.marker
                if marker is not None:
                    seen = tail + data
                    if marker in seen:
                        with self._lock:
                            self.marked += seen.count(marker)
                        if self.holding:
                            held.set()  # before the command reaches Redis: its reply cannot slip through
                    tail = seen[-len(marker) + 1:] if len(marker) > 1 else b""
                sink.sendall(data)
                if self.rate:
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        _shut(sink)

    def _to_client(self, source: socket.socket, sink: socket.socket, held: threading.Event) -> None:
        try:
            while data := source.recv(CHUNK):
                if held.is_set():
                    self.released.wait()
                sink.sendall(data)
        except OSError:
            pass
        _shut(sink)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
