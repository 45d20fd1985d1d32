"""The API's serving engine (app/api/serving/engine.py) against a real Redis: the order of errors,
the worker choice, a bounded wait (503) when nobody answers, requests whose worker process is gone
sent again, and a burst answered in order. Requests go in as the multipart bodies clients send;
the worker side is played by hand here (tests/app/api/serving/support.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
import redis

from app.api.serving.engine import PredictionClient
from core import keys
from core.errors import Conflict, InvalidInput, NotFound, TooLarge, Unavailable, UnsupportedMedia
from core.wire import PredictRequest
from tests.app.api.serving.support import image, predict, prediction_client, register_device, worker_redis


def test_errors_come_in_order_and_no_worker_is_a_quick_503(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    sync.hset(keys.job("queuedjob"), "status", "queued")
    sync.hset(keys.job("donejob"), "status", "succeeded")

    async def scenario() -> None:
        client = prediction_client(clean_redis_url, timeout_s=60)
        good = [image()]
        with pytest.raises(InvalidInput):
            await predict(client, "donejob", [], 5)
        with pytest.raises(InvalidInput):
            await predict(client, None, good, 5)
        with pytest.raises(TooLarge):
            await predict(client, "donejob", good * 5, 5)
        with pytest.raises(UnsupportedMedia):  # the image is judged before the job
            await predict(client, "nosuchjob", [("a", b"x")], 5)
        with pytest.raises(NotFound):
            await predict(client, "nosuchjob", good, 5)
        with pytest.raises(Conflict):
            await predict(client, "queuedjob", good, 5)
        with pytest.raises(Unavailable, match="no live worker"):  # at once: nothing was queued to wait for
            await predict(client, "donejob", good, 5)
        assert not await client.redis.keys("ty:predict:*")
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())


def test_a_worker_that_never_answers_is_a_503_after_the_timeout(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    sync.hset(keys.job("donejob"), "status", "succeeded")
    register_device(sync, "n/cpu", [])

    async def scenario() -> None:
        client = prediction_client(clean_redis_url, timeout_s=0.5)
        with pytest.raises(Unavailable, match="did not answer"):
            await predict(client, "donejob", [image()], 5)
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())
    queued = PredictRequest.decode(worker_redis(clean_redis_url).lpop(keys.predict_queue("n/cpu")))  # it reached the list
    assert queued.header.job_id == "donejob" and queued.header.deadline > queued.header.queued_at
    assert queued.image(0) == image()  # the bytes the client sent, as they were


def test_reply_passthrough_and_worker_choice(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    sync.hset(keys.job("donejob"), "status", "succeeded")
    register_device(sync, "n/cpu", [], status="busy")
    register_device(sync, "n/cuda:0", ["donejob"], status="busy")  # holds the model: preferred
    register_device(sync, "n/cuda:1", [], status="idle")

    def fake_worker(body: str) -> None:
        _, raw = worker_redis(clean_redis_url).blpop([keys.predict_queue("n/cuda:0")], timeout=5)
        request = PredictRequest.decode(raw)
        sync.rpush(request.header.reply_to, f"{request.header.request_id} {body}")

    async def scenario() -> None:
        client = prediction_client(clean_redis_url, timeout_s=5)
        loop = asyncio.get_running_loop()
        answer = '{"job_id": "donejob", "results": []}'
        worker = loop.run_in_executor(None, fake_worker, f"200 {answer}")
        assert await predict(client, "donejob", [image()], 3) == answer.encode()
        await worker
        worker = loop.run_in_executor(None, fake_worker, '415 {"detail": "x.png: cannot decode image"}')
        with pytest.raises(UnsupportedMedia, match="cannot decode"):
            await predict(client, "donejob", [image()], 3)
        await worker
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())


def test_a_request_whose_worker_process_is_gone_is_sent_again(clean_redis_url: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ways a worker holding a request goes away; each time the request is taken back off that
    worker's list and answered by a live one, with its id and deadline unchanged."""
    import app.api.serving.engine as engine
    from app.api.serving.devices import LIVE_CACHE_S

    monkeypatch.setattr(engine, "WATCH_S", 0.1)
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    sync.hset(keys.job("donejob"), "status", "succeeded")

    raw = worker_redis(clean_redis_url)

    def worker(device_id: str) -> PredictRequest:
        """Play `device_id`'s worker: take a request and answer it."""
        _, message = raw.blpop([keys.predict_queue(device_id)], timeout=10)
        request = PredictRequest.decode(message)
        sync.rpush(request.header.reply_to, f"{request.header.request_id} 200 " + json.dumps({"device": device_id}))
        return request

    async def predict_one(client: PredictionClient) -> dict:
        return json.loads(await predict(client, "donejob", [image()], 3))

    def queued(device_id: str) -> bytes | None:
        return raw.lindex(keys.predict_queue(device_id), 0)

    async def until(predicate: Callable[[], object]) -> None:
        for _ in range(1000):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("waited 10 s")

    orphaned: list[float] = []

    async def scenario() -> None:
        client = prediction_client(clean_redis_url, timeout_s=20)
        client.on_orphaned = orphaned.append
        loop = asyncio.get_running_loop()

        # (1) Its worker took it and died (its alive key lapsed): sent to the other device.
        register_device(sync, "a/cpu", ["donejob"], instance="a-1")  # holds the model: chosen first
        register_device(sync, "b/cpu", [], instance="b-1")
        pending = asyncio.ensure_future(predict_one(client))
        _, taken = await loop.run_in_executor(None, lambda: raw.blpop([keys.predict_queue("a/cpu")], timeout=10))
        sync.delete(keys.device_alive("a/cpu"))  # taken by a/cpu's worker, which now dies with it
        again = await loop.run_in_executor(None, worker, "b/cpu")
        assert (await pending)["device"] == "b/cpu"
        assert again.raw == taken  # the same message, byte for byte: id, deadline and images unchanged

        # (2) Its worker died before taking it, and a fresh worker process holds the device now: the
        # dead one's copy is taken back off the list (nobody computes it) and a new one sent, which
        # the fresh process (its device holds the model) answers.
        register_device(sync, "a/cpu", ["donejob"], instance="a-2")
        sync.delete(keys.device_alive("b/cpu"))
        await asyncio.sleep(LIVE_CACHE_S)
        pending = asyncio.ensure_future(predict_one(client))
        await until(lambda: queued("a/cpu"))
        original = queued("a/cpu")
        assert original is not None
        sync.set(keys.device_alive("a/cpu"), "a-3", px=60_000)  # the restart
        # The copy is taken back and the same message queued again (a resend re-encodes nothing).
        await until(lambda: sum(orphaned) == 2)
        await until(lambda: queued("a/cpu") is not None)
        served = await loop.run_in_executor(None, worker, "a/cpu")
        assert (await pending)["device"] == "a/cpu"
        assert served.raw == original
        assert sync.llen(keys.predict_queue("a/cpu")) == 0  # the first copy is gone: taken back

        # (3) No live worker for a while: the request waits (no 503) and goes to the first worker back.
        pending = asyncio.ensure_future(predict_one(client))
        await until(lambda: queued("a/cpu"))
        sync.delete(keys.device_alive("a/cpu"))
        await until(lambda: sync.llen(keys.predict_queue("a/cpu")) == 0)  # taken back
        await asyncio.sleep(3 * engine.WATCH_S)  # rounds with nobody to send it to
        assert not pending.done()
        register_device(sync, "b/cpu", [], instance="b-2")
        await loop.run_in_executor(None, worker, "b/cpu")
        assert (await pending)["device"] == "b/cpu"

        # (4) Its worker's device broke (the worker is alive, restarting: it serves no more): sent to b.
        register_device(sync, "a/cpu", ["donejob"], instance="a-5")
        await asyncio.sleep(LIVE_CACHE_S)
        pending = asyncio.ensure_future(predict_one(client))
        await until(lambda: queued("a/cpu"))
        register_device(sync, "a/cpu", ["donejob"], status="broken", instance="a-5")
        await loop.run_in_executor(None, worker, "b/cpu")
        assert (await pending)["device"] == "b/cpu" and sync.llen(keys.predict_queue("a/cpu")) == 0
        assert sum(orphaned) == 4  # what /metrics counts: one request taken back in each case
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())


def test_a_burst_of_predictions_is_queued_in_one_round_trip_and_answered_in_order(clean_redis_url: str) -> None:
    """PredictionClient end to end with a hand-played worker: 24 concurrent requests for a succeeded
    job and one for a job that is not: 24 queued, one Conflict, every answer to its own caller."""
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    sync.hset(keys.job("donejob"), "status", "succeeded")
    sync.hset(keys.job("runningjob"), "status", "running")
    register_device(sync, "n/cpu", [])

    def fake_worker(count: int) -> None:
        raw = worker_redis(clean_redis_url)
        for _ in range(count):
            _, message = raw.blpop([keys.predict_queue("n/cpu")], timeout=5)
            request = PredictRequest.decode(message)
            body = json.dumps({"job_id": request.header.job_id, "results": [{"filename": request.image(0)[0]}]})
            sync.rpush(request.header.reply_to, f"{request.header.request_id} 200 {body}")

    async def scenario() -> None:
        client = prediction_client(clean_redis_url, timeout_s=10)
        worker = asyncio.get_running_loop().run_in_executor(None, fake_worker, 24)
        names = [image(name=f"{i}.png") for i in range(24)]
        answers = await asyncio.gather(*(predict(client, "donejob", [image], 1) for image in names),
                                       predict(client, "runningjob", [image()], 1), return_exceptions=True)
        await worker
        assert [json.loads(a)["results"][0]["filename"] for a in answers[:24]] == [f"{i}.png" for i in range(24)]
        assert isinstance(answers[24], Conflict)
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())


