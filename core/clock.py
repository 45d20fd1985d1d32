"""Time, as the contract writes it and as every host agrees on it.

Timestamps in records are ISO-8601 UTC strings (`utc_now_iso`). Decisions that compare a time
written by one host with a time read by another (a lease's expiry, a prediction's deadline) use
Redis's clock (`redis_now`): hosts' wall clocks drift apart, the one Redis they share has one.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def utc_now_iso() -> str:
    """Now, as an ISO-8601 UTC string (what every `*_at` field and heartbeat carries)."""
    return datetime.now(UTC).isoformat()


def seconds_from_time_reply(reply: Any) -> float:
    """Redis TIME's reply, (seconds, microseconds), as epoch seconds."""
    seconds, micros = reply
    return int(seconds) + int(micros) / 1_000_000


def redis_now(client: Any) -> float:
    """Redis's clock in epoch seconds (one TIME round trip), for times other hosts compare."""
    return seconds_from_time_reply(client.time())


async def redis_now_async(client: Any) -> float:
    """`redis_now` on an asyncio Redis client."""
    return seconds_from_time_reply(await client.time())
