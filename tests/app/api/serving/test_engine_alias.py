"""/predict by alias, the API side, against a real Redis: the name is resolved to a job and the
request is queued only while the alias still names that job; otherwise nothing is queued and the
name is resolved again. The worker side is played by hand, as in test_engine.py."""

from __future__ import annotations

import asyncio
import json

import redis

from app.api.serving.transport import MOVED
from core import keys
from core.wire import PredictRequest
from tests.app.api.serving.support import image, predict, prediction_client, register_device, worker_redis


def test_a_request_is_queued_for_the_job_the_alias_names_at_that_moment(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    for job_id in ("jobaaaa", "jobbbbb"):
        sync.hset(keys.job(job_id), "status", "succeeded")
    sync.hset(keys.ALIASES, "pets", "jobaaaa")
    register_device(sync, "n/cpu", [])
    served: list[PredictRequest] = []

    def fake_worker() -> None:
        """Takes the request; before answering it, the alias moves (as a PUT /aliases/pets would)."""
        _, raw = worker_redis(clean_redis_url).blpop([keys.predict_queue("n/cpu")], timeout=5)
        request = PredictRequest.decode(raw)
        served.append(request)
        # The worker writes the alias the request named into its answer (worker/serving/replies.py).
        body = {"job_id": request.header.job_id, "model": "cifar_net", "device": "n/cpu", "results": [],
                "alias": request.header.alias}
        sync.rpush(request.header.reply_to, f"{request.header.request_id} 200 {json.dumps(body)}")

    async def scenario() -> None:
        client = prediction_client(clean_redis_url, timeout_s=5)
        # The script refuses to queue for a job the alias no longer names: nothing reaches the list.
        script_result = await client.transport.queue("n/cpu", "jobbbbb", b"message", alias="pets")
        assert script_result == MOVED and await client.redis.llen(keys.predict_queue("n/cpu")) == 0
        sync.hset(keys.ALIASES, "pets", "jobbbbb")
        worker = asyncio.get_running_loop().run_in_executor(None, fake_worker)
        answer = json.loads(await predict(client, None, [image()], 3, alias="pets"))
        await worker
        assert (answer["job_id"], answer["alias"]) == ("jobbbbb", "pets")
        assert (served[0].header.job_id, served[0].header.alias) == ("jobbbbb", "pets")
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())
