"""Redis outages ridden out (worker/runtime/outages.py) against a real redis-server stopped and started
again: a call waits while Redis is away and goes on when it answers, saying both once; a worker that
is shutting down stops waiting at once."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import redis

from app.embedded_redis import EmbeddedRedis
from tests.support import wait_until
from worker.runtime.outages import ride_out_outage


def test_a_call_waits_out_an_outage_and_goes_on_when_redis_is_back(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    server = EmbeddedRedis(tmp_path)
    server.start()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        client.set("written", "before the outage")
        server.stop()
        answered: list[str | None] = []
        caller = threading.Thread(target=lambda: answered.append(
            ride_out_outage(lambda: client.get("written"), halted=lambda: False, what="a test's read")))
        with caplog.at_level(logging.WARNING, logger="worker.runtime.outages"):
            caller.start()
            wait_until(lambda: "a test's read paused: Redis is unavailable" in caplog.text, what="the pause logged")
            assert caller.is_alive() and answered == []  # waiting, not failed
            server.start()
            caller.join(timeout=30)
        assert answered == ["before the outage"]
        assert caplog.text.count("paused") == 1 and "a test's read goes on: Redis answered again" in caplog.text
    finally:
        client.close()
        server.stop()


def test_a_worker_shutting_down_stops_waiting(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path)
    client = redis.Redis.from_url(server.url, decode_responses=True)  # never started: Redis is away
    with pytest.raises(redis.ConnectionError):
        ride_out_outage(client.ping, halted=lambda: True, what="a test's ping")
    client.close()
