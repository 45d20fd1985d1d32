"""Server-sent events from a job's Redis stream. Stream ids are the SSE ids, so a client that
reconnects with Last-Event-ID continues exactly where it stopped, even across API restarts."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import Request

from app.core.errors import InvalidInput
from app.core.jobs import events_key, job_key
from app.core.schemas import JobStatus

KEEPALIVE_MS = 15_000
_TERMINAL = {s.value for s in JobStatus if s.terminal}
_STREAM_ID = re.compile(r"^[0-9]{1,20}(-[0-9]{1,20})?$")


def parse_last_event_id(value: str | None) -> str | None:
    """Checked before the stream starts: a bad id would otherwise break the stream mid-response."""
    if value is None or value == "":
        return None
    if not _STREAM_ID.fullmatch(value.strip()):
        raise InvalidInput(f"Last-Event-ID {value[:64]!r} is not an event id from this stream (like 1700000000000-0)")
    return value.strip()


async def job_event_stream(client: aioredis.Redis, job_id: str, last_event_id: str | None,
                           request: Request) -> AsyncIterator[str]:
    cursor = last_event_id or "0-0"
    yield "retry: 2000\n\n"
    while True:
        if await request.is_disconnected():
            return
        batch = await client.xread({events_key(job_id): cursor}, count=100)
        if not batch:
            if await client.hget(job_key(job_id), "status") in _TERMINAL:
                return  # the terminal event was sent before this client's Last-Event-ID
            batch = await client.xread({events_key(job_id): cursor}, block=KEEPALIVE_MS, count=100)
            if not batch:
                yield ": keepalive\n\n"
                continue
        for event_id, fields in batch[0][1]:
            cursor = event_id
            yield f"id: {event_id}\nevent: {fields['event']}\ndata: {fields['data']}\n\n"
            if fields["event"] == "status" and json.loads(fields["data"]).get("status") in _TERMINAL:
                return
