"""core.redis against a real Redis that restarts (found by `make compose-test`: after
`docker compose restart redis` the API's asyncio client failed the next command on each pooled
connection, breaking SSE streams and predictions)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from app.embedded_redis import EmbeddedRedis
from core.redis import connect, connect_async


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
