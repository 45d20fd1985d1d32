"""Server-sent events from a job's Redis stream. Stream ids are the SSE ids, so a client that
reconnects with Last-Event-ID continues exactly where it stopped, even across API restarts.

The framing, keep-alive pings and client-disconnect handling are sse-starlette's; what is ours is
where the events come from and when the stream ends (after the terminal status).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator

import redis
import redis.asyncio as aioredis
from sse_starlette import EventSourceResponse, ServerSentEvent

from core import keys
from core.errors import InvalidInput
from core.schemas import JobStatus

log = logging.getLogger(__name__)

# A client is told to reconnect after this, and the connection is pinged this often so proxies
# and the client's read timeout (60 s in client/sdk.py) never see a silent stream.
RETRY_MS = 2000
PING_S = 15
# One XREAD waits at most this long for a new event before it looks again.
BLOCK_MS = 15_000
_TERMINAL = {s.value for s in JobStatus if s.terminal}
_STREAM_ID = re.compile(r"^[0-9]{1,20}(-[0-9]{1,20})?$")


def parse_last_event_id(value: str | None) -> str | None:
    """Checked before the stream starts: a bad id would otherwise break the stream mid-response."""
    if value is None or value == "":
        return None
    if not _STREAM_ID.fullmatch(value.strip()):
        raise InvalidInput(f"Last-Event-ID {value[:64]!r} is not an event id from this stream (like 1700000000000-0)")
    return value.strip()


async def _job_events(client: aioredis.Redis, job_id: str, last_event_id: str | None,
                      record: str | None = None, stream: str | None = None, status_field: str = "status",
                      ) -> AsyncIterator[ServerSentEvent]:
    """A job's events (or, given its record's and stream's keys, another record's: a sweep's, whose
    record says it ended in `ended`: a cancelled sweep's `status` is set before its trials are told)."""
    cursor = last_event_id or "0-0"
    yield ServerSentEvent(retry=RETRY_MS)
    try:
        async for event in _read_events(client, record or keys.job(job_id), stream or keys.job_events(job_id),
                                        cursor, status_field):
            yield event
    except redis.RedisError as exc:
        # Redis went away mid-stream: the status line was sent long ago, so end the stream cleanly;
        # the client reconnects with Last-Event-ID and gets a 503 until Redis is back, then the rest.
        log.warning("event stream of %s ended: Redis is unavailable (%s)", record or f"job {job_id}", exc)


async def _read_events(client: aioredis.Redis, record: str, stream: str, cursor: str, status_field: str
                       ) -> AsyncIterator[ServerSentEvent]:
    while True:
        batch = await client.xread({stream: cursor}, count=100)
        if not batch:
            if await client.hget(record, status_field) in _TERMINAL:
                # The terminal status and its event are written in one transaction, so the event is
                # in the stream by now: it may have landed between the read above and this one (the
                # stream then ended without it, a race a client reconnecting near the end lost).
                batch = await client.xread({stream: cursor}, count=100)
                if not batch:
                    return  # the terminal event was sent before this client's Last-Event-ID
            else:
                batch = await client.xread({stream: cursor}, block=BLOCK_MS, count=100)
                if not batch:
                    continue
        for event_id, fields in batch[0][1]:
            cursor = event_id
            yield ServerSentEvent(fields["data"], event=fields["event"], id=event_id)
            if fields["event"] == "status" and json.loads(fields["data"]).get("status") in _TERMINAL:
                return


def job_event_response(client: aioredis.Redis, job_id: str, last_event_id: str | None) -> EventSourceResponse:
    return EventSourceResponse(_job_events(client, job_id, last_event_id), ping=PING_S, sep="\n",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sweep_event_response(client: aioredis.Redis, sweep_id: str, last_event_id: str | None) -> EventSourceResponse:
    """A sweep's events (core/sweeps/records.py): `trial` (asked, told) and `status`, ending with its end."""
    return EventSourceResponse(_job_events(client, sweep_id, last_event_id, keys.sweep(sweep_id),
                                           keys.sweep_events(sweep_id), "ended"),
                               ping=PING_S, sep="\n", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
