"""The transport stage (app/api/serving/transport.py) against a real Redis: a message reaches a
device's list only for a succeeded job (and, by alias, only while the alias still names it); it is
taken back by its exact bytes; the scripts of one event-loop turn go in one pipeline."""

from __future__ import annotations

import asyncio
import uuid

import redis
import redis.asyncio as aioredis

from app.api.serving.transport import MOVED, CoalescedScripts, Transport
from core import keys
from core.redis import connect_async


def test_a_message_is_queued_for_a_succeeded_job_and_only_while_its_alias_names_it(clean_redis_url: str) -> None:
    sync = redis.Redis.from_url(clean_redis_url)
    sync.hset(keys.job("donejob"), "status", "succeeded")
    sync.hset(keys.job("runningjob"), "status", "running")
    sync.hset(keys.ALIASES, "pets", "donejob")
    queue = keys.predict_queue("n/cpu")

    async def scenario() -> None:
        client = connect_async(clean_redis_url)
        transport = Transport(client)
        assert await transport.queue("n/cpu", "donejob", b"one") == "succeeded"
        assert await transport.queue("n/cpu", "runningjob", b"two") == "running"  # answered, not queued
        assert await transport.queue("n/cpu", "nosuchjob", b"three") is None
        assert await transport.queue("n/cpu", "donejob", memoryview(b"four"), alias="pets") == "succeeded"
        assert await transport.queue("n/cpu", "runningjob", b"five", alias="pets") == MOVED  # it names donejob
        assert sync.lrange(queue, 0, -1) == [b"one", b"four"]
        await transport.take_back("n/cpu", memoryview(b"one"))
        await transport.take_back("n/cpu", b"not there")  # nothing to take: no error
        assert sync.lrange(queue, 0, -1) == [b"four"]
        await client.aclose()

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
