"""app/corked.py: a turn's writes reach the socket in one call, in order, and close/abort see them."""

from __future__ import annotations

import asyncio
import socket

from app.corked import CorkedTransport


class _Counting(asyncio.Protocol):
    pass


async def _pair() -> tuple[CorkedTransport, asyncio.Transport, socket.socket, list[str]]:
    """A corked transport over a real socket pair, each call on the real transport recorded."""
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_connection(_Counting, sock=ours)
    calls: list[str] = []
    real_write, real_writelines = transport.write, transport.writelines

    def write(data: bytes) -> None:
        if calls[-1:] != ["writelines…"]:  # asyncio's own writelines joins and writes: one call, not two
            calls.append("write")
        real_write(data)

    def writelines(chunks: list[bytes]) -> None:
        calls.append("writelines…")
        real_writelines(chunks)
        calls[-1] = "writelines"

    transport.write, transport.writelines = write, writelines  # type: ignore[method-assign, assignment]
    theirs.setblocking(False)
    return CorkedTransport(transport, loop), transport, theirs, calls


async def _received(peer: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < size:
        data += await loop.sock_recv(peer, size - len(data))
    return data


def test_one_turns_writes_go_in_one_call_in_order() -> None:
    async def scenario() -> None:
        corked, _, peer, calls = await _pair()
        corked.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        corked.write(b"")
        corked.write(b"{}")
        assert calls == []  # held until the turn ends
        await asyncio.sleep(0)
        assert calls == ["writelines"]
        assert await _received(peer, 40) == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
        corked.write(b"next")  # a later turn: a call of its own
        await asyncio.sleep(0)
        assert calls == ["writelines", "write"]
        assert await _received(peer, 4) == b"next"
        corked.close()
        peer.close()

    asyncio.run(scenario())


def test_close_sends_what_is_held_and_abort_drops_it() -> None:
    async def scenario() -> None:
        corked, transport, peer, _ = await _pair()
        corked.write(b"last words")
        corked.close()  # in the same turn as the write
        assert transport.is_closing()
        assert await _received(peer, 10) == b"last words"
        assert await asyncio.get_running_loop().sock_recv(peer, 1) == b""  # then the end of the stream
        peer.close()

        corked, transport, peer, calls = await _pair()
        corked.write(b"never sent")
        assert corked.get_write_buffer_size() == 10
        corked.abort()
        await asyncio.sleep(0)
        assert calls == [] and transport.is_closing()
        peer.close()

    asyncio.run(scenario())
