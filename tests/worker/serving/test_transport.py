"""The worker's transport stage off its list (worker/serving/transport.py): the intake's reads go
over a connection of its own with commands packed once, and still behave as the client's own
commands did: frames taken in order and whole, a connection Redis dropped replaced without a
lost poll, an unreachable Redis an error the intake's outage handling sees."""

from __future__ import annotations

import pytest
import redis

from core import keys
from core.redis import connect
from worker.serving.transport import Transport


def test_first_and_more_take_the_list_in_order_and_whole(clean_redis_url: str) -> None:
    client = connect(clean_redis_url, decode_responses=False)
    transport = Transport(client, "node/cpu")
    queue = keys.predict_queue("node/cpu")
    frames = [bytes([i]) * (40_000 + i) for i in range(7)]  # larger than one socket read each
    client.rpush(queue, *frames)
    assert transport.take_first(3) == frames[:3]
    assert transport.take_more(2) == frames[3:5]
    assert transport.take_more(32) == frames[5:]
    assert transport.take_more(32) == []
    client.rpush(queue, b"late")
    assert transport.take_first(32) == [b"late"]


def test_a_connection_redis_dropped_is_replaced_and_the_poll_answered(clean_redis_url: str) -> None:
    client = connect(clean_redis_url, decode_responses=False)
    transport = Transport(client, "node/cpu")
    queue = keys.predict_queue("node/cpu")
    assert transport.take_more(4) == []  # its connection is open now
    killed = client.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1
    client.rpush(queue, b"after the kill")
    assert transport.take_more(4) == [b"after the kill"]


def test_an_unreachable_redis_is_the_callers_outage() -> None:
    client = connect("redis://127.0.0.1:1/0", decode_responses=False)  # nothing listens on port 1
    transport = Transport(client, "node/cpu")
    with pytest.raises(redis.ConnectionError):
        transport.take_more(4)
