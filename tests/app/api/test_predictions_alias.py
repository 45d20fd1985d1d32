"""/predict by alias, the API side, against a real Redis: the name is resolved to a job and the
request is queued only while the alias still names that job; otherwise nothing is queued and the
name is resolved again. The worker side is played by hand, as in test_predictions.py."""

from __future__ import annotations

import asyncio
import json
import time

import redis

from app.api.predictions import _MOVED, PredictionClient, _InFlight
from core import keys
from core.redis import connect_async
from core.wire import PredictRequest
from tests.app.api.test_predictions import _image, _register_device


def test_a_request_is_queued_for_the_job_the_alias_names_at_that_moment(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    for job_id in ("jobaaaa", "jobbbbb"):
        sync.hset(keys.job(job_id), "status", "succeeded")
    sync.hset(keys.ALIASES, "pets", "jobbbbb")
    _register_device(sync, "n/cpu", [])

    def fake_worker() -> None:
        _, raw = sync.blpop([keys.predict_queue("n/cpu")], timeout=5)
        request = PredictRequest.decode(raw)
        body = {"job_id": request.job_id, "model": "cifar_net", "device": "n/cpu", "results": [], "alias": None}
        sync.rpush(request.reply_to, f"{request.request_id} 200 {json.dumps(body)}")

    async def scenario() -> None:
        client = PredictionClient(connect_async(clean_redis_url), timeout_s=5, max_bytes=1 << 20,
                                  max_pixels=10_000, max_images=4)
        # resolved to jobaaaa a moment ago, but the alias moved to jobbbbb since: nothing is queued
        stale = _InFlight("jobaaaa", "pets", [_image()], 3, "some-request", time.time() + 5,
                          asyncio.get_running_loop().create_future())
        assert await client._queue(stale) == _MOVED and await client.redis.llen(keys.predict_queue("n/cpu")) == 0
        assert stale.holder is None
        worker = asyncio.get_running_loop().run_in_executor(None, fake_worker)
        answer = json.loads(await client.predict(None, [_image()], 3, alias="pets"))
        await worker
        assert (answer["job_id"], answer["alias"]) == ("jobbbbb", "pets")
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())
