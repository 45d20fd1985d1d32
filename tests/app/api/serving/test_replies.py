"""The replies stage (app/api/serving/replies.py) on a real Redis: answers pushed to a process's inbox,
in bulk, resolve the requests they are addressed to; a malformed or unexpected one is dropped; a
wait is bounded; and when Redis cannot be reached every waiting request fails at once."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from app.api.serving.replies import ReplyInbox
from core.redis import connect_async
from core.wire import PredictReply
from tests.support import free_port


def test_answers_pushed_in_bulk_resolve_their_own_requests(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)

    async def scenario() -> None:
        client = connect_async(clean_redis_url)
        inbox = ReplyInbox(client)
        waiting = [inbox.expect(timeout_s=30) for _ in range(3)]
        # One RPUSH for a whole batch, as a worker's replies stage sends it; among them an answer
        # for a request nobody waits for and a line that is no reply at all.
        sync.rpush(inbox.key, PredictReply(200, '{"n": 2}').encode_to(waiting[2][0]), "garbage",
                   PredictReply(200, '{"n": 0}').encode_to(waiting[0][0]),
                   PredictReply(200, "{}").encode_to("nobody"),
                   PredictReply(404, '{"detail": "job x not found"}').encode_to(waiting[1][0]))
        replies = await asyncio.gather(*(answer for _, answer in waiting))
        assert [(r.status, r.body) for r in replies] == [(200, '{"n": 0}'), (404, '{"detail": "job x not found"}'),
                                                         (200, '{"n": 2}')]
        for request_id, answer in waiting:
            inbox.forget(request_id, answer)
        assert sync.llen(inbox.key) == 0  # every line was taken, the unusable ones dropped
        await inbox.close()
        await client.aclose()

    asyncio.run(scenario())


def test_a_wait_nobody_answers_ends_with_a_timeout(clean_redis_url: str) -> None:
    async def scenario() -> None:
        client = connect_async(clean_redis_url)
        inbox = ReplyInbox(client)
        request_id, answer = inbox.expect(timeout_s=0.2)
        with pytest.raises(TimeoutError):
            await answer
        inbox.forget(request_id, answer)
        await inbox.close()
        await client.aclose()

    asyncio.run(scenario())


def test_every_waiting_request_fails_at_once_when_redis_cannot_be_reached() -> None:
    async def scenario() -> None:
        client = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1)  # nothing listens
        inbox = ReplyInbox(client)
        waiting = [inbox.expect(timeout_s=600) for _ in range(2)]
        for _, answer in waiting:
            with pytest.raises(redis.ConnectionError):
                await answer  # not after its 600 s: as soon as the listener fails
        await inbox.close()
        await client.aclose()

    asyncio.run(scenario())
