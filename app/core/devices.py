"""The live device registry: what each worker writes from its heartbeat thread, what /devices reads.

Each device has a state record (kept, so a dead worker still shows as offline) and an `alive`
key with a TTL that only its owning worker instance refreshes. The alive key doubles as the
device lock: a second worker for the same device id is refused while the first is alive.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import redis

from app.core.errors import DeviceInUse, InvalidInput
from app.core.redis import KEY_PREFIX
from app.core.schemas import Device

DEVICES_INDEX = f"{KEY_PREFIX}devices"
OFFLINE_FORGET_S = 7 * 24 * 3600

# Refresh the alive key only if this instance still owns it.
_REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


def state_key(device_id: str) -> str:
    return f"{KEY_PREFIX}device:{device_id}"


def alive_key(device_id: str) -> str:
    return f"{KEY_PREFIX}device:{device_id}:alive"


def predict_queue(device_id: str) -> str:
    return f"{KEY_PREFIX}predict:{device_id}"


class DeviceRegistry:
    def __init__(self, client: redis.Redis, ttl_s: float) -> None:
        self.redis = client
        self.ttl_ms = int(ttl_s * 1000)
        self._refresh = client.register_script(_REFRESH)

    # -------------------------------------------------------------- worker side
    def acquire(self, device_id: str, instance: str, holder_is_dead: Callable[[dict], bool] = lambda _: False) -> None:
        """Take the device for this worker instance, or refuse if another live worker holds it.

        `holder_is_dead` lets a restarted worker take over at once from its own crashed
        predecessor on the same host instead of waiting out the TTL."""
        if not self.redis.set(alive_key(device_id), instance, nx=True, px=self.ttl_ms):
            holder = self.state(device_id)
            if holder and holder_is_dead(holder):
                self.redis.set(alive_key(device_id), instance, px=self.ttl_ms)
                self.redis.sadd(DEVICES_INDEX, device_id)
                return
            who = f"{holder.get('worker')} (pid {holder.get('pid')})" if holder else "another worker"
            raise DeviceInUse(f"device {device_id} is already held by {who}; stop it first or "
                              f"wait {self.ttl_ms / 1000:.0f}s for its heartbeat to lapse")
        self.redis.sadd(DEVICES_INDEX, device_id)

    def publish(self, device_id: str, instance: str, state: dict[str, Any]) -> bool:
        """Write this device's state and refresh its liveness; False if another instance took it."""
        pipe = self.redis.pipeline()
        pipe.set(state_key(device_id), json.dumps(state), ex=OFFLINE_FORGET_S)
        pipe.sadd(DEVICES_INDEX, device_id)
        pipe.execute()
        return bool(self._refresh(keys=[alive_key(device_id)], args=[instance, self.ttl_ms]))

    def release(self, device_id: str, instance: str, state: dict[str, Any]) -> None:
        """Mark offline at once on a clean shutdown instead of waiting for the TTL."""
        if self.redis.get(alive_key(device_id)) == instance:
            self.redis.delete(alive_key(device_id))
        self.redis.set(state_key(device_id), json.dumps(state), ex=OFFLINE_FORGET_S)

    # -------------------------------------------------------------- reader side
    def state(self, device_id: str) -> dict[str, Any] | None:
        raw = self.redis.get(state_key(device_id))
        return json.loads(raw) if raw else None

    def all(self) -> list[Device]:
        ids = sorted(self.redis.smembers(DEVICES_INDEX))
        if not ids:
            return []
        pipe = self.redis.pipeline()
        for device_id in ids:
            pipe.get(state_key(device_id))
            pipe.exists(alive_key(device_id))
        replies = pipe.execute()
        devices = []
        for raw, alive in zip(replies[0::2], replies[1::2], strict=True):
            if not raw:
                continue
            state = json.loads(raw)
            if not alive:
                state.update(status="offline", current_job=None, loaded_models=[])
            devices.append(Device.model_validate(state))
        return devices

    def live(self) -> list[Device]:
        return [d for d in self.all() if d.status != "offline"]

    def known_ids(self) -> set[str]:
        return set(self.redis.smembers(DEVICES_INDEX))

    def validate_request(self, requested: str) -> str:
        """A job's `device`: auto, cuda, cpu, or the id of a device a worker has registered."""
        if requested in ("auto", "cuda", "cpu") or requested in self.known_ids():
            return requested
        known = ", ".join(sorted(self.known_ids())) or "none registered yet"
        raise InvalidInput(f"unknown device {requested!r}: use auto, cuda, cpu or a device id ({known})")


def utc_now() -> str:
    return datetime.now(UTC).isoformat()
