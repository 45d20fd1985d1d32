"""Time, as the contract writes it and as every host agrees on it.

Timestamps in records are ISO-8601 UTC strings (`utc_now_iso`). Decisions that compare a time
written by one host with a time read by another (a lease's expiry, a prediction's deadline) use
Redis's clock (`redis_now`): hosts' wall clocks drift apart, the one Redis they share has one.
"""

from __future__ import annotations

import time
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


class RedisClock:
    """This process's estimate of Redis's clock, from its own: Redis time = local time + offset.

    A prediction's `queued_at` and `deadline` are written by an API process and read by a worker,
    maybe on another host whose wall clock is off by minutes; compared as wall-clock times, a
    worker ahead by more than the timeout would drop every request as expired, and one behind
    would hold each batch open for the skew. Both sides therefore speak Redis's clock: each keeps
    the offset of Redis TIME from its own wall clock, taken at the midpoint of a TIME round trip
    (so it is off by at most half that round trip) and sampled again every `refresh_s`, which also
    follows a wall clock stepped while the process runs. A sample whose round trip took more than
    twice the best recent one (it waited behind a busy Redis) does not move the offset, unless the
    offset is older than `4 × refresh_s`."""

    def __init__(self, refresh_s: float = 1.0) -> None:
        self.refresh_s = refresh_s
        self.offset: float | None = None  # seconds: Redis's clock minus this host's
        self._sampled_at = float("-inf")  # local monotonic time of the last sample
        self._accepted_at = float("-inf")  # ... and of the last one that set the offset
        self._best_round_trip = float("inf")

    def due(self, now_monotonic: float) -> bool:
        return self.offset is None or now_monotonic - self._sampled_at >= self.refresh_s

    def observe(self, local_before: float, redis_reply: Any, local_after: float, now_monotonic: float) -> None:
        """One TIME round trip: the local wall clock read before and after it, and Redis's reply."""
        round_trip = max(0.0, local_after - local_before)
        stale = self.offset is None or now_monotonic - self._accepted_at >= 4 * self.refresh_s
        if stale or round_trip <= 2 * self._best_round_trip:
            self.offset = seconds_from_time_reply(redis_reply) - (local_before + local_after) / 2
            self._best_round_trip = round_trip if stale else min(self._best_round_trip, round_trip)
            self._accepted_at = now_monotonic
        self._sampled_at = now_monotonic

    def sample(self, client: Any) -> None:
        """A blocking sample on a synchronous client."""
        before = time.time()
        reply = client.time()
        self.observe(before, reply, time.time(), time.monotonic())

    def now(self) -> float:
        """Redis's clock now, as estimated (the local clock until a first sample)."""
        return time.time() + (self.offset or 0.0)

    def to_local(self, redis_time: float) -> float:
        """A time on Redis's clock as this host's wall clock reads it."""
        return redis_time - (self.offset or 0.0)
