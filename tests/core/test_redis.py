"""core.redis against a real Redis that restarts (found by `make compose-test`: after
`docker compose restart redis` the API's asyncio client failed the next command on each pooled
connection, breaking SSE streams and predictions)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import redis

from app.embedded_redis import EmbeddedRedis
from core.redis import WRITE_SLICE_BYTES, connect, connect_async, execute_once


def test_both_clients_reconnect_by_themselves_after_a_redis_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    try:
        sync_client = connect(url)
        sync_client.set("k", "before")

        async def use_async(client, value: str) -> str | None:
            await client.xadd("events", {"v": value})
            return (await client.xrange("events"))[-1][1]["v"]

        async def scenario() -> None:
            client = connect_async(url)
            try:
                assert await use_async(client, "before") == "before"
                server.stop()  # SIGTERM: the append-only file is flushed, as in a container stop
                server.start()
                # The same client, the same pooled connection, now dead: the call must still work.
                assert await use_async(client, "after") == "after"
            finally:
                await client.aclose()

        asyncio.run(scenario())
        assert sync_client.get("k") == "before"
        assert [fields["v"] for _, fields in sync_client.xrange("events")] == ["before", "after"]
    finally:
        server.stop()


def test_execute_once_sends_large_values_whole_and_survives_a_redis_restart(tmp_path: Path) -> None:
    """execute_once never retries, so a pooled connection that Redis closed (a restart) must be
    replaced before anything is written: the first call after the restart works (the pool checks a
    connection it hands out). A value larger
    than a write slice arrives whole, next to small commands, and an error answers its own command."""
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    large = bytearray(os.urandom(3 * WRITE_SLICE_BYTES + 12345))

    async def scenario() -> None:
        client = connect_async(url)
        try:
            replies = await execute_once(client, [("RPUSH", "l", memoryview(large)), ("INCR", "l"), ("RPUSH", "l", "x")])
            assert replies[0] == 1 and isinstance(replies[1], redis.ResponseError) and replies[2] == 2
            # The restart takes its time, and the client's event loop runs meanwhile (it sees the close).
            await asyncio.get_running_loop().run_in_executor(None, lambda: (server.stop(), server.start()))
            assert await execute_once(client, [("RPUSH", "l", "after")]) == [3]
        finally:
            await client.aclose()

    asyncio.run(scenario())
    try:
        stored = redis.Redis.from_url(url).lrange("l", 0, -1)
        assert stored == [bytes(large), b"x", b"after"]
    finally:
        server.stop()


def test_the_api_client_serves_more_concurrent_commands_than_redis_pys_default_pool(clean_redis_url: str) -> None:
    """150 commands in flight at once on one API client, as 150 concurrent requests of one busy API
    process have: each gets a connection (redis-py's asyncio pool refuses the 101st by default,
    "Too many connections", which 128 /predict clients of one API process reached)."""

    async def scenario() -> list[object]:
        client = connect_async(clean_redis_url)
        try:
            return await asyncio.gather(*(client.blpop([f"nothing-{i}"], timeout=0.5) for i in range(150)))
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == [None] * 150
