"""A connection's writes of one event-loop turn, sent in one system call.

uvicorn writes a response in (at least) two calls on its transport: the status line and headers
when the app sends `http.response.start`, the body at `http.response.body`. Each is a `send` of
its own on the socket, and a small /predict answer paid two system calls (and, on a loopback or
virtualised network, two wake-ups of the reader) where one carries both: the API's CPU per
request counted it (docs/benchmarks.md, "The service's own CPU per request"). `CorkedTransport`
holds what is written until the end of the current turn of the loop (`call_soon`), the way
Node's `socket.cork()` with `process.nextTick(uncork)` does, and writes it then with one
`writelines` (uvloop: one `writev`, nothing copied). A response is never held longer than the turn
that wrote it, so nothing waits on a timer; `close`, `write_eof` and `abort` see the held bytes
first (sent, sent, dropped), so the order of what reaches the peer is unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any


class CorkedTransport:
    """Wraps one connection's transport; every other attribute is the transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes | bytearray | memoryview] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        held, self._held = self._held, []
        if not held or self._transport.is_closing():
            return
        if len(held) == 1:
            self._transport.write(held[0])
        else:
            self._transport.writelines(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(chunk) for chunk in self._held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
