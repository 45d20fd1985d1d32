"""The devices stage: which workers can take a prediction now, which one a request goes to, and
Redis's clock.

Read from Redis at most every LIVE_CACHE_S by each API process (one pipeline: every device's
record and alive key, and Redis TIME), shared by every request of that process. A request goes to
a device that holds its model already, else to an idle one (`pick_device`). The alive key names
the worker process holding the device (core/devices.alive_instances), which is how a request
whose worker process is gone is recognised. Redis TIME rides the same pipeline so the process
always knows Redis's clock (core/clock.RedisClock), the one a prediction's `queued_at` and
`deadline` are written in, as the worker's transport stage keeps it on its side.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import redis.asyncio as aioredis

from core import keys
from core.clock import RedisClock
from core.devices import SERVING, alive_instances, devices_from_replies, liveness_reads
from core.schemas import Device

LIVE_CACHE_S = 0.5
LIVE_READ_TIMEOUT_S = 5.0


class LiveDevices:
    def __init__(self, client: aioredis.Redis, read_timeout_s: float = LIVE_READ_TIMEOUT_S) -> None:
        self.redis = client
        self.read_timeout_s = min(read_timeout_s, LIVE_READ_TIMEOUT_S)
        self.clock = RedisClock(refresh_s=LIVE_CACHE_S)
        self.devices: list[Device] = []
        self.instances: dict[str, str] = {}  # live device id → the worker process holding it
        self._read_at = 0.0
        self._reading: asyncio.Future[list[Device]] | None = None
        self._turn = itertools.count()

    def forget(self) -> None:
        """Read again at the next call (a worker did not answer: it may be gone)."""
        self._read_at = 0.0

    def holder(self, device_id: str) -> str | None:
        return self.instances.get(device_id)

    def pick_device(self, job_id: str, live: list[Device]) -> Device:
        """Prefer a worker that already holds the model, then an idle one; rotate among equals."""
        best = min(d.status != "idle" for d in live) if not any(job_id in d.loaded_models for d in live) else None
        if best is None:
            candidates = [d for d in live if job_id in d.loaded_models]
        else:
            candidates = [d for d in live if (d.status != "idle") == best]
        return candidates[next(self._turn) % len(candidates)]

    async def read(self) -> list[Device]:
        """The devices that serve predictions, at most LIVE_CACHE_S old."""
        if time.monotonic() - self._read_at < LIVE_CACHE_S:
            return self.devices
        # One read for every request that finds the cache stale (a burst would otherwise send one
        # each); shielded, so that a caller that goes away does not cancel it for the others.
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read())
        return await asyncio.shield(self._reading)

    async def _read(self) -> list[Device]:
        # Bounded: every request in the process waits on this one read, and a connection that
        # hangs (half-open, no socket timeout reached) must not hold them all; the next one reads anew.
        live: list[Device] = []
        instances: dict[str, str] = {}
        async with asyncio.timeout(self.read_timeout_s):
            ids = sorted(await self.redis.smembers(keys.DEVICES_INDEX))
            pipe = self.redis.pipeline(transaction=False)
            pipe.time()
            liveness_reads(pipe, ids)
            before = time.time()
            replies = await pipe.execute()
            self.clock.observe(before, replies[0], time.time(), time.monotonic())
            replies = replies[1:]
            if ids:
                live = [d for d in devices_from_replies(replies) if d.status in SERVING]
                instances = alive_instances(ids, replies)
        self.devices, self._read_at = live, time.monotonic()
        self.instances = {d.id: instances[d.id] for d in live if d.id in instances}
        return live
