"""Server-sent events from a job's Redis stream. Stream ids are the SSE ids, so a client that
reconnects with Last-Event-ID continues exactly where it stopped, even across API restarts."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import Request

from app.core.jobs import events_key, job_key
from app.core.schemas import JobStatus

KEEPALIVE_MS = 15_000
_TERMINAL = {s.value for s in JobStatus if s.terminal}


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
