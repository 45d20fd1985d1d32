"""Device slots (core/devices/slots.py): what the Lua scripts decide when a worker starts a task
(refused or not) and ends one (free, or held for the gang it was promised to), against a real
Redis, is what core/gangs/policy.py's `read_slot` and `single_may_start` decide of the same slot."""

from __future__ import annotations

import pytest
import redis

from core import keys
from core.clock import redis_now
from core.devices import DeviceSlots
from core.gangs.policy import read_slot, single_may_start


@pytest.fixture
def client(clean_redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(clean_redis_url, decode_responses=True)


def test_the_slot_scripts_decide_as_the_policy_does(client: redis.Redis) -> None:
    """Starting a single-device job (refused or not) and ending a task (free, or held for the gang it
    was promised to), by the Lua scripts, against core/gangs/policy.read_slot and single_may_start."""
    client.zadd(keys.GANGS_WAITING, {"gang.t": 0})
    now = redis_now(client)
    future, past = f"{now + 60:.6f}", f"{now - 1:.6f}"
    slots = {
        "empty": {},
        "busy": {"state": "busy", "job": "x", "token": "t"},
        "reserved": {"state": "reserved", "job": "gang", "deadline": future},
        "reserved, lapsed": {"state": "reserved", "job": "gang", "deadline": past},
        "held": {"state": "held", "job": "gang", "entry": "gang.t", "deadline": future},
        "held, lapsed": {"state": "held", "job": "gang", "entry": "gang.t", "deadline": past},
        "held, its gang gone": {"state": "held", "job": "gone", "entry": "gone.t", "deadline": future},
        "held, by an older worker": {"state": "held", "job": "gang", "deadline": future},
    }
    for name, raw in slots.items():
        device = f"take-{len(name)}-{name.replace(' ', '')}/cpu"
        if raw:
            client.hset(keys.device_slot(device), mapping=raw)
        expected = single_may_start(read_slot(device, raw, redis_now(client), {"gang.t"}))
        assert DeviceSlots(client, device).take_for_job("single", "s") == expected, name
    promises = {
        "promised": {"hold_job": "gang", "hold_entry": "gang.t", "hold_deadline": future},
        "promise lapsed": {"hold_job": "gang", "hold_entry": "gang.t", "hold_deadline": past},
        "promised to a gang gone": {"hold_job": "gone", "hold_entry": "gone.t", "hold_deadline": future},
        "not promised": {},
    }
    for name, promise in promises.items():
        device = f"release-{name.replace(' ', '')}/cpu"
        raw = {"state": "busy", "job": "x", "token": "t", **promise}
        client.hset(keys.device_slot(device), mapping=raw)
        view = read_slot(device, raw, redis_now(client), {"gang.t"})
        DeviceSlots(client, device).release("x", "t")
        after = client.hgetall(keys.device_slot(device))
        assert (after.get("state") == "held") == bool(view.promised), name
        assert after == ({"state": "held", "job": "gang", "entry": "gang.t", "deadline": future}
                         if view.promised else {}), name
