"""The replies stage: one reply list per API process, read by one listener: how /predict answers come back.

The worker's replies stage (worker/serving/replies.py) RPUSHes what this one reads. Before this, each request BLPOPped a reply list of its own: a second Redis call per prediction,
each holding a pooled connection while it waited (32 concurrent requests, 32 connections). Now a
request registers a future under a fresh id and the worker RPUSHes the answers of a whole batch
to this process's inbox in one call; the listener pops them in bulk (BLPOP and an LPOP of up to
`DRAIN` more, in one write, fewer instructions per prediction even at one client:
bench/api_instructions.py, docs/benchmarks.md) and resolves the futures.

A request's wait is bounded by a timer of the loop's that fails its future with TimeoutError
(cancelled once the answer is in), rather than `asyncio.wait_for`, which builds a second future
and a task wrapper around each wait. Answers nobody waits for any more (the caller timed out)
are dropped. The inbox's TTL is renewed by every push, so the list of an API process that died
expires by itself (core/wire.REPLY_TTL_S). When the listener cannot reach Redis, every waiting
request fails at once with that error (a 503 for its client) rather than waiting out its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

import redis
import redis.asyncio as aioredis

from core import keys
from core.redis import RECONNECT_PAUSE_S
from core.wire import MalformedMessage, PredictReply

log = logging.getLogger(__name__)

DRAIN = 512  # answers popped per call after the first: a batch's worth and more
BLOCK_S = 1.0  # how long one BLPOP waits: bounds how late the listener sees a stop
RETRIES = 3  # reconnections before the waiting requests are failed (the client's own retry: core/redis.py)


class ReplyInbox:
    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self.key = keys.predict_reply(f"inbox-{secrets.token_hex(12)}")
        self._waiting: dict[str, tuple[asyncio.Future[PredictReply], asyncio.TimerHandle]] = {}
        self._listener: asyncio.Task[None] | None = None
        self._closing = False

    def expect(self, timeout_s: float) -> tuple[str, asyncio.Future[PredictReply]]:
        """A fresh request id and the future its answer will resolve; TimeoutError once `timeout_s`
        have passed without one."""
        loop = asyncio.get_running_loop()
        if self._listener is None or self._listener.done():
            self._listener = loop.create_task(self._listen(), name="torchyard-reply-inbox")
        request_id = secrets.token_hex(8)
        future: asyncio.Future[PredictReply] = loop.create_future()
        self._waiting[request_id] = (future, loop.call_later(timeout_s, _time_out, future))
        return request_id, future

    def forget(self, request_id: str, answer: asyncio.Future[PredictReply]) -> None:
        """The caller stopped waiting (answered, timed out, failed before it waited, or cancelled)."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            waiting[1].cancel()
        if not answer.done():
            answer.cancel()
        elif not answer.cancelled():
            answer.exception()  # read: a timeout nobody awaited (the request failed first) is not logged

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        self._closing = True  # redis-py can turn the cancellation of a BLPOP into a ConnectionError
        if listener is not None:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(listener, BLOCK_S + 1)

    async def _listen(self) -> None:
        # BLPOP and an LPOP of what queued beside it, in one write on a connection of the listener's
        # own, packed once: Redis runs the LPOP as soon as the BLPOP returns, so a lone answer costs
        # one round trip and a batch's are taken whole. Not redis-py's pipeline: building one per
        # call, its retry wrapper and its per-command reply callbacks were a large share of this
        # process's Python time at one client (docs/benchmarks.md).
        connection = self.redis.connection_pool.make_connection()
        packed = connection.pack_commands([("BLPOP", self.key, BLOCK_S), ("LPOP", self.key, DRAIN)])
        failures = 0
        try:
            while not self._closing:
                try:
                    await connection.send_packed_command(packed, check_health=False)
                    first, rest = await connection.read_response(), await connection.read_response()
                    raw = ([first[1]] if first is not None else []) + (rest or [])
                    failures = 0
                except redis.RedisError as exc:
                    await connection.disconnect(nowait=True)  # whatever it was in the middle of
                    if self._closing:
                        return
                    failures += 1
                    if failures <= RETRIES:  # a Redis restart: reconnect, as the client's own retry does
                        await asyncio.sleep(RECONNECT_PAUSE_S * 2 ** (failures - 1))
                        continue
                    self._fail_all(exc)
                    await asyncio.sleep(0.2)
                    continue
                for item in raw:
                    try:
                        request_id, reply = PredictReply.decode_addressed(item)
                    except MalformedMessage as exc:
                        log.warning("dropped a malformed reply (%s)", exc)
                        continue
                    waiting = self._waiting.pop(request_id, None)
                    if waiting is not None:
                        future, timer = waiting
                        timer.cancel()
                        if not future.done():
                            future.set_result(reply)
        finally:  # stopped (closing or cancelled): the listener's connection goes with it
            await asyncio.shield(connection.disconnect(nowait=True))

    def _fail_all(self, exc: Exception) -> None:
        waiting, self._waiting = self._waiting, {}
        for future, timer in waiting.values():
            timer.cancel()
            if not future.done():
                future.set_exception(exc)


def _time_out(future: asyncio.Future[PredictReply]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())
