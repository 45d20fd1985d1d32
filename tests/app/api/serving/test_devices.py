"""The devices stage (app/api/serving/devices.py) on a real Redis: only devices whose worker serves
now take predictions, each named with the worker process holding it; a request goes where its model
is resident, else to an idle device, turn by turn; a burst reads Redis once."""

from __future__ import annotations

import asyncio

import redis

from app.api.serving.devices import LiveDevices
from core import keys
from core.redis import connect_async
from tests.app.api.serving.support import register_device


def test_the_live_view_holds_serving_devices_and_their_worker_processes(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    register_device(sync, "n/cpu", [], status="idle", instance="cpu-1")
    register_device(sync, "n/cuda:0", [], status="busy", instance="gpu-1")
    register_device(sync, "n/cuda:1", [], status="broken", instance="gpu-2")  # alive, serving nothing
    register_device(sync, "m/cpu", [], instance="gone")
    sync.delete(keys.device_alive("m/cpu"))  # its worker's heartbeat lapsed

    async def scenario() -> None:
        client = connect_async(clean_redis_url)
        live = LiveDevices(client)
        assert sorted(d.id for d in await live.read()) == ["n/cpu", "n/cuda:0"]
        assert (live.holder("n/cpu"), live.holder("n/cuda:0"), live.holder("m/cpu")) == ("cpu-1", "gpu-1", None)
        sync.delete(keys.device_alive("n/cpu"))
        assert len(await live.read()) == 2  # the cached view, until it is forgotten or old
        live.forget()
        assert [d.id for d in await live.read()] == ["n/cuda:0"]
        await client.aclose()

    asyncio.run(scenario())


def test_a_request_goes_where_its_model_is_resident_else_to_an_idle_device_in_turn(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    register_device(sync, "a/cpu", ["job-1"], status="busy")
    register_device(sync, "b/cpu", [], status="idle")
    register_device(sync, "c/cpu", [], status="idle")

    async def scenario() -> None:
        client = connect_async(clean_redis_url)
        live = LiveDevices(client)
        devices = await live.read()
        assert {live.pick_device("job-1", devices).id for _ in range(4)} == {"a/cpu"}  # busy, but resident
        assert {live.pick_device("job-2", devices).id for _ in range(4)} == {"b/cpu", "c/cpu"}  # the idle ones
        busy = [d for d in devices if d.id == "a/cpu"]
        assert live.pick_device("job-2", busy).id == "a/cpu"  # none idle: a busy one still takes it
        await client.aclose()

    asyncio.run(scenario())


def test_a_burst_that_finds_the_view_stale_reads_redis_once(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    register_device(sync, "n/cpu", [])
    before = sync.info("commandstats").get("cmdstat_smembers", {}).get("calls", 0)

    async def scenario() -> None:
        client = connect_async(clean_redis_url)
        live = LiveDevices(client)
        views = await asyncio.gather(*(live.read() for _ in range(16)))
        assert all([d.id for d in view] == ["n/cpu"] for view in views)
        await client.aclose()

    asyncio.run(scenario())
    assert sync.info("commandstats")["cmdstat_smembers"]["calls"] - before == 1
