"""The API side of /predict against a real Redis: header checks, the order of errors, the worker
choice, and a bounded wait (503) when nobody answers. Requests go in as the multipart bodies
clients send; the worker side is played by hand here."""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from collections.abc import Callable

import httpx
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from PIL import Image
from starlette.requests import Request

from app.api.coalesced_scripts import CoalescedScripts
from app.api.predictions import PredictionClient, check_image
from core import keys
from core.config import Settings
from core.errors import Conflict, InvalidInput, NotFound, TooLarge, Unavailable, UnsupportedMedia
from core.redis import connect_async
from core.wire import PredictRequest


def _image(fmt: str = "PNG", size: tuple[int, int] = (8, 8), name: str | None = None) -> tuple[str, bytes]:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((size[1], size[0], 3), dtype=np.uint8)).save(buffer, format=fmt)
    return name or f"x.{fmt.lower()}", buffer.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF"])
def test_accepted_formats_pass_the_header_check(fmt: str) -> None:
    check_image(*_image(fmt), max_pixels=100)


def test_header_check_refusals() -> None:
    with pytest.raises(UnsupportedMedia):
        check_image("a.txt", b"hello", 100)
    with pytest.raises(UnsupportedMedia):
        check_image("empty.png", b"", 100)
    with pytest.raises(UnsupportedMedia):
        check_image(*_image("TIFF"), 100)
    with pytest.raises(TooLarge, match="TORCHYARD_MAX_IMAGE_PIXELS"):
        check_image(*_image(size=(20, 20)), max_pixels=100)


def _client(url: str, timeout_s: float = 1.0) -> PredictionClient:
    settings = Settings(predict_timeout_s=timeout_s, max_image_bytes=1 << 20, max_image_pixels=10_000,
                        max_images_per_request=4)
    return PredictionClient(connect_async(url), settings)


def _raw(url: str) -> redis.Redis:
    """A client as the worker's: prediction requests are binary frames."""
    return redis.Redis.from_url(url)


async def _predict(client: PredictionClient, job_id: str | None, images: list[tuple[str, bytes]], top_k: int,
                   alias: str | None = None) -> bytes:
    """POST /predict's body as httpx sends it, through PredictionClient.answer."""
    fields = {"top_k": str(top_k), **({"job_id": job_id} if job_id else {}), **({"alias": alias} if alias else {})}
    return await client.answer(_form_request([("file", (name, data, "image/png")) for name, data in images], fields))


def _register_device(sync: redis.Redis, device_id: str, loaded: list[str], status: str = "idle",
                     instance: str = "instance") -> None:
    state = {"id": device_id, "type": "cpu", "index": None, "name": "cpu", "memory_total_bytes": 1,
             "memory_used_bytes": 0, "utilization_percent": None, "worker": f"cpu@{device_id}", "status": status,
             "current_job": None, "loaded_models": loaded, "last_heartbeat": "2026-01-01T00:00:00+00:00"}
    sync.set(keys.device_state(device_id), json.dumps(state))
    sync.set(keys.device_alive(device_id), instance, px=60_000)
    sync.sadd(keys.DEVICES_INDEX, device_id)


def test_errors_come_in_order_and_no_worker_is_a_quick_503(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    sync.hset(keys.job("queuedjob"), "status", "queued")
    sync.hset(keys.job("donejob"), "status", "succeeded")

    async def scenario() -> None:
        client = _client(clean_redis_url, timeout_s=60)
        good = [_image()]
        with pytest.raises(InvalidInput):
            await _predict(client, "donejob", [], 5)
        with pytest.raises(InvalidInput):
            await _predict(client, None, good, 5)
        with pytest.raises(TooLarge):
            await _predict(client, "donejob", good * 5, 5)
        with pytest.raises(UnsupportedMedia):  # the image is judged before the job
            await _predict(client, "nosuchjob", [("a", b"x")], 5)
        with pytest.raises(NotFound):
            await _predict(client, "nosuchjob", good, 5)
        with pytest.raises(Conflict):
            await _predict(client, "queuedjob", good, 5)
        with pytest.raises(Unavailable, match="no live worker"):  # at once: nothing was queued to wait for
            await _predict(client, "donejob", good, 5)
        assert not await client.redis.keys("ty:predict:*")
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())


def test_a_worker_that_never_answers_is_a_503_after_the_timeout(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    sync.hset(keys.job("donejob"), "status", "succeeded")
    _register_device(sync, "n/cpu", [])

    async def scenario() -> None:
        client = _client(clean_redis_url, timeout_s=0.5)
        with pytest.raises(Unavailable, match="did not answer"):
            await _predict(client, "donejob", [_image()], 5)
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())
    queued = PredictRequest.decode(_raw(clean_redis_url).lpop(keys.predict_queue("n/cpu")))  # it reached the list
    assert queued.header.job_id == "donejob" and queued.header.deadline > queued.header.queued_at
    assert queued.image(0) == _image()  # the bytes the client sent, as they were


def test_reply_passthrough_and_worker_choice(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    sync.hset(keys.job("donejob"), "status", "succeeded")
    _register_device(sync, "n/cpu", [], status="busy")
    _register_device(sync, "n/cuda:0", ["donejob"], status="busy")  # holds the model: preferred
    _register_device(sync, "n/cuda:1", [], status="idle")

    def fake_worker(body: str) -> None:
        _, raw = _raw(clean_redis_url).blpop([keys.predict_queue("n/cuda:0")], timeout=5)
        request = PredictRequest.decode(raw)
        sync.rpush(request.header.reply_to, f"{request.header.request_id} {body}")

    async def scenario() -> None:
        client = _client(clean_redis_url, timeout_s=5)
        loop = asyncio.get_running_loop()
        answer = '{"job_id": "donejob", "results": []}'
        worker = loop.run_in_executor(None, fake_worker, f"200 {answer}")
        assert await _predict(client, "donejob", [_image()], 3) == answer.encode()
        await worker
        worker = loop.run_in_executor(None, fake_worker, '415 {"detail": "x.png: cannot decode image"}')
        with pytest.raises(UnsupportedMedia, match="cannot decode"):
            await _predict(client, "donejob", [_image()], 3)
        await worker
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())


def test_a_request_whose_worker_process_is_gone_is_sent_again(clean_redis_url: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ways a worker holding a request goes away; each time the request is taken back off that
    worker's list and answered by a live one, with its id and deadline unchanged."""
    import app.api.predictions as predictions
    from app.api.live_devices import LIVE_CACHE_S

    monkeypatch.setattr(predictions, "WATCH_S", 0.1)
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    sync.hset(keys.job("donejob"), "status", "succeeded")

    raw = _raw(clean_redis_url)

    def worker(device_id: str) -> PredictRequest:
        """Play `device_id`'s worker: take a request and answer it."""
        _, message = raw.blpop([keys.predict_queue(device_id)], timeout=10)
        request = PredictRequest.decode(message)
        sync.rpush(request.header.reply_to, f"{request.header.request_id} 200 " + json.dumps({"device": device_id}))
        return request

    async def predict(client: PredictionClient) -> dict:
        return json.loads(await _predict(client, "donejob", [_image()], 3))

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
        client = _client(clean_redis_url, timeout_s=20)
        client.on_orphaned = orphaned.append
        loop = asyncio.get_running_loop()

        # (1) Its worker took it and died (its alive key lapsed): sent to the other device.
        _register_device(sync, "a/cpu", ["donejob"], instance="a-1")  # holds the model: chosen first
        _register_device(sync, "b/cpu", [], instance="b-1")
        pending = asyncio.ensure_future(predict(client))
        _, taken = await loop.run_in_executor(None, lambda: raw.blpop([keys.predict_queue("a/cpu")], timeout=10))
        sync.delete(keys.device_alive("a/cpu"))  # taken by a/cpu's worker, which now dies with it
        again = await loop.run_in_executor(None, worker, "b/cpu")
        assert (await pending)["device"] == "b/cpu"
        assert again.raw == taken  # the same message, byte for byte: id, deadline and images unchanged

        # (2) Its worker died before taking it, and a fresh worker process holds the device now: the
        # dead one's copy is taken back off the list (nobody computes it) and a new one sent, which
        # the fresh process (its device holds the model) answers.
        _register_device(sync, "a/cpu", ["donejob"], instance="a-2")
        sync.delete(keys.device_alive("b/cpu"))
        await asyncio.sleep(LIVE_CACHE_S)
        pending = asyncio.ensure_future(predict(client))
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
        pending = asyncio.ensure_future(predict(client))
        await until(lambda: queued("a/cpu"))
        sync.delete(keys.device_alive("a/cpu"))
        await until(lambda: sync.llen(keys.predict_queue("a/cpu")) == 0)  # taken back
        await asyncio.sleep(3 * predictions.WATCH_S)  # rounds with nobody to send it to
        assert not pending.done()
        _register_device(sync, "b/cpu", [], instance="b-2")
        await loop.run_in_executor(None, worker, "b/cpu")
        assert (await pending)["device"] == "b/cpu"

        # (4) Its worker's device broke (the worker is alive, restarting: it serves no more): sent to b.
        _register_device(sync, "a/cpu", ["donejob"], instance="a-5")
        await asyncio.sleep(LIVE_CACHE_S)
        pending = asyncio.ensure_future(predict(client))
        await until(lambda: queued("a/cpu"))
        _register_device(sync, "a/cpu", ["donejob"], status="broken", instance="a-5")
        await loop.run_in_executor(None, worker, "b/cpu")
        assert (await pending)["device"] == "b/cpu" and sync.llen(keys.predict_queue("a/cpu")) == 0
        assert sum(orphaned) == 4  # what /metrics counts: one request taken back in each case
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())


def _connections_named(sync: redis.Redis, name: str) -> int:
    """Clients connected under `name`, as Redis itself counts them."""
    return sum(1 for c in sync.client_list() if c.get("name") == name)


def test_the_scripts_of_one_turn_go_in_one_pipeline_and_answer_their_own_callers(clean_redis_url: str) -> None:
    """32 callers at once: one connection carries all 32 scripts (not 32), each caller gets its own
    result or its own error, and a script Redis has forgotten (NOSCRIPT, as after a restart) is
    loaded and run once, not lost."""
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)

    name = f"coalesced-{uuid.uuid4().hex[:12]}"

    async def scenario() -> None:
        client = aioredis.Redis.from_url(clean_redis_url, decode_responses=True, client_name=name)
        scripts = CoalescedScripts(client)
        # Unique text: a script no server has cached, so the first pipeline meets NOSCRIPT.
        push = client.register_script(f"-- {uuid.uuid4()}\n"
                                      "if ARGV[1] == 'bad' then return redis.error_reply('refused') end\n"
                                      "redis.call('RPUSH', KEYS[1], ARGV[1]) return ARGV[1]")
        args = [str(i) for i in range(31)] + ["bad"]
        results = await asyncio.gather(*(scripts.run(push, ["pushed"], [a]) for a in args), return_exceptions=True)
        assert results[:31] == args[:31]
        assert isinstance(results[31], redis.ResponseError) and "refused" in str(results[31])
        assert sync.lrange("pushed", 0, -1) == args[:31]  # each ran once, in the callers' order
        assert _connections_named(sync, name) == 1
        # a lone call (a plain EVALSHA) and a later burst reuse the same connection
        assert await scripts.run(push, ["pushed"], ["alone"]) == "alone"
        assert await asyncio.gather(*(scripts.run(push, ["pushed"], [a]) for a in "xyz")) == list("xyz")
        assert _connections_named(sync, name) == 1 and sync.llen("pushed") == 35
        sync.script_flush()  # Redis forgets the script: the next burst meets NOSCRIPT
        assert await asyncio.gather(*(scripts.run(push, ["pushed"], [a]) for a in "uvw")) == list("uvw")
        sync.script_flush()  # and alone
        assert await scripts.run(push, ["pushed"], ["lone"]) == "lone"
        assert sync.lrange("pushed", 35, -1) == ["u", "v", "w", "lone"]  # each once
        await client.aclose()

    asyncio.run(scenario())


def test_a_caller_that_gives_up_leaves_the_others_answered(clean_redis_url: str) -> None:
    async def scenario() -> None:
        client = connect_async(clean_redis_url)
        scripts = CoalescedScripts(client)
        echo = client.register_script("return ARGV[1]")
        calls = [asyncio.ensure_future(scripts.run(echo, [], [str(i)])) for i in range(8)]
        await asyncio.sleep(0)  # the calls are made and pending; one caller goes away
        calls[3].cancel()
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(results[3], asyncio.CancelledError)
        assert [r for i, r in enumerate(results) if i != 3] == [str(i) for i in range(8) if i != 3]
        await client.aclose()

    asyncio.run(scenario())


def test_a_burst_of_predictions_is_queued_in_one_round_trip_and_answered_in_order(clean_redis_url: str) -> None:
    """PredictionClient end to end with a hand-played worker: 24 concurrent requests for a succeeded
    job and one for a job that is not: 24 queued, one Conflict, every answer to its own caller."""
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    sync.hset(keys.job("donejob"), "status", "succeeded")
    sync.hset(keys.job("runningjob"), "status", "running")
    _register_device(sync, "n/cpu", [])

    def fake_worker(count: int) -> None:
        raw = _raw(clean_redis_url)
        for _ in range(count):
            _, message = raw.blpop([keys.predict_queue("n/cpu")], timeout=5)
            request = PredictRequest.decode(message)
            body = json.dumps({"job_id": request.header.job_id, "results": [{"filename": request.image(0)[0]}]})
            sync.rpush(request.header.reply_to, f"{request.header.request_id} 200 {body}")

    async def scenario() -> None:
        client = _client(clean_redis_url, timeout_s=10)
        worker = asyncio.get_running_loop().run_in_executor(None, fake_worker, 24)
        names = [_image(name=f"{i}.png") for i in range(24)]
        answers = await asyncio.gather(*(_predict(client, "donejob", [image], 1) for image in names),
                                       _predict(client, "runningjob", [_image()], 1), return_exceptions=True)
        await worker
        assert [json.loads(a)["results"][0]["filename"] for a in answers[:24]] == [f"{i}.png" for i in range(24)]
        assert isinstance(answers[24], Conflict)
        await client.close()
        await client.redis.aclose()

    asyncio.run(scenario())


def _form_request(files: list[tuple[str, tuple]], data: dict[str, str], chunk: int | None = None) -> Request:
    """A Starlette request carrying exactly the multipart body httpx would send (in chunks of
    `chunk` bytes, as a slow client's body arrives, when given)."""
    built = httpx.Request("POST", "http://x/predict", files=files, data=data)
    body = built.read()
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    pieces = pieces or [b""]

    async def receive() -> dict:
        piece = pieces.pop(0) if pieces else b""
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    headers = [(k.lower().encode(), v.encode()) for k, v in built.headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/predict", "headers": headers, "query_string": b""},
                   receive)
