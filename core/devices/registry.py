"""The live device registry: what each worker writes from its heartbeat thread, what /devices reads.

Each device has a state record (kept, so a dead worker still shows as offline) and an `alive`
key with a TTL that only its owning worker instance refreshes. The alive key doubles as the
device lock: a second worker for the same device id is refused while the first is alive.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import redis

from core import keys
from core.access.projects import acting, project_of, visible
from core.devices.slots import slot_states
from core.errors import DeviceInUse, InvalidInput
from core.gangs.policy import waiting_note
from core.gangs.records import GangRecords
from core.kinds.train.params import TrainingParams
from core.schemas import Device, Job, JobStatus

OFFLINE_FORGET_S = 7 * 24 * 3600


def new_instance(pid: int) -> str:
    """A worker process's instance token: its pid, then random bytes (the pid lets a successor on
    the same host tell that this process is gone, `instance_pid`; the rest makes it unique)."""
    return f"{pid}.{secrets.token_hex(8)}"


def instance_pid(instance: str) -> int | None:
    """The pid an instance token names; None for a token without one (an older worker's)."""
    pid, dot, _ = instance.partition(".")
    return int(pid) if dot and pid.isdigit() else None

# Write the state record and refresh the alive key, only if this instance still owns the device
# (or it lapsed and nobody took it: a heartbeat that stalled past the TTL takes it back).
_PUBLISH = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] or not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
  redis.call('SADD', KEYS[3], ARGV[5])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
  return 1
end
return 0
"""


def liveness_reads(pipe: Any, device_ids: Sequence[str]) -> None:
    """Queue, for each device, a read of its record and of its alive key (sync or async pipeline).
    The alive key's value is the holding worker process's instance token (`alive_instances`)."""
    for device_id in device_ids:
        pipe.get(keys.device_state(device_id))
        pipe.get(keys.device_alive(device_id))


# The statuses of a device whose worker takes jobs and predictions.
SERVING = ("idle", "busy")


def alive_instances(device_ids: Sequence[str], replies: Sequence[Any]) -> dict[str, str]:
    """Device id → the instance token of the worker process holding it now, for the devices of
    `liveness_reads`'s replies that are alive. A worker restarted on the same device has a new
    token: what it did not finish of its predecessor's work is lost with that process."""
    return {device_id: alive if isinstance(alive, str) else alive.decode()
            for device_id, alive in zip(device_ids, replies[1::2], strict=True) if alive}


def devices_from_replies(replies: Sequence[Any]) -> list[Device]:
    """The devices of `liveness_reads`'s replies; one without a fresh alive key shows as offline,
    or as broken while its last record says its device broke (until a fresh worker replaces it)."""
    devices = []
    for raw, alive in zip(replies[0::2], replies[1::2], strict=True):
        if not raw:
            continue
        state = json.loads(raw)
        if not alive:
            state.update(status="broken" if state.get("fault") else "offline", current_job=None, loaded_models=[])
        devices.append(Device.model_validate(state))
    return devices


class DeviceRegistry:
    def __init__(self, client: redis.Redis, ttl_s: float) -> None:
        self.redis = client
        self.ttl_ms = int(ttl_s * 1000)
        self._publish = client.register_script(_PUBLISH)
        self._release = client.register_script(_RELEASE)

    # -------------------------------------------------------------- worker side
    def acquire(self, device_id: str, instance: str, holder_is_dead: Callable[[dict], bool] = lambda _: False) -> None:
        """Take the device for this worker instance, or refuse if another live worker holds it.

        `holder_is_dead` lets a restarted worker take over at once from its own crashed
        predecessor on the same host instead of waiting out the TTL."""
        if not self.redis.set(keys.device_alive(device_id), instance, nx=True, px=self.ttl_ms):
            holder = self.state(device_id)
            if holder and holder_is_dead(holder):
                self.redis.set(keys.device_alive(device_id), instance, px=self.ttl_ms)
                self.redis.sadd(keys.DEVICES_INDEX, device_id)
                return
            who = f"{holder.get('worker')} (pid {holder.get('pid')})" if holder else "another worker"
            raise DeviceInUse(f"device {device_id} is already held by {who}; stop it first or "
                              f"wait {self.ttl_ms / 1000:.0f}s for its heartbeat to lapse")
        self.redis.sadd(keys.DEVICES_INDEX, device_id)

    def publish(self, device_id: str, instance: str, state: Device) -> bool:
        """Write this device's state and refresh its liveness; False (and nothing written) if another
        instance took the device, e.g. after this one stalled past the TTL."""
        return bool(self._publish(keys=[keys.device_alive(device_id), keys.device_state(device_id), keys.DEVICES_INDEX],
                                  args=[instance, self.ttl_ms, state.model_dump_json(), OFFLINE_FORGET_S, device_id]))

    def release(self, device_id: str, instance: str, state: Device) -> None:
        """Mark offline at once on a clean shutdown instead of waiting for the TTL (only if this
        instance still holds the device: never overwrite a successor's record)."""
        self._release(keys=[keys.device_alive(device_id), keys.device_state(device_id)],
                      args=[instance, state.model_dump_json(), OFFLINE_FORGET_S])

    # -------------------------------------------------------------- reader side
    def state(self, device_id: str) -> dict[str, Any] | None:
        raw = self.redis.get(keys.device_state(device_id))
        return json.loads(raw) if raw else None

    def all(self) -> list[Device]:
        ids = sorted(self.redis.smembers(keys.DEVICES_INDEX))
        if not ids:
            return []
        pipe = self.redis.pipeline()
        liveness_reads(pipe, ids)
        return devices_from_replies(pipe.execute())

    def seen(self) -> list[Device]:
        """Every device as the request's project may see it (core/access/projects.py): all of them,
        but another project's job on one only as its status ("busy"), not its id, and none of the
        other projects' models resident on it."""
        devices = self.all()
        if acting().sees is None:
            return devices
        ids = sorted({j for d in devices for j in (d.current_job, *d.loaded_models) if j})
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(keys.job(job_id), "project")
        mine = {job_id for job_id, p in zip(ids, pipe.execute(), strict=True) if visible(project_of(p))}
        return [d.model_copy(update={"current_job": d.current_job if d.current_job in mine else None,
                                     "loaded_models": [m for m in d.loaded_models if m in mine]}) for d in devices]

    def live(self) -> list[Device]:
        return [d for d in self.all() if d.status in SERVING]

    def known_ids(self) -> set[str]:
        return set(self.redis.smembers(keys.DEVICES_INDEX))

    def waiting_note(self, requested: str, live: list[Device]) -> str | None:
        """Why a job for `requested` cannot start now, or None when a live worker could take it."""
        if requested == "auto":
            return None if live else "no worker is online; the job stays queued until one starts"
        if requested in ("cuda", "cpu"):
            if any(d.type == requested for d in live):
                return None
            kind = "GPU" if requested == "cuda" else "CPU"
            return f"no {kind} worker is online; the job stays queued until one starts"
        if any(d.id == requested for d in live):
            return None
        return (f"device {requested} is offline (no live worker); the job stays queued and runs "
                f"when its worker is back")

    def annotate(self, jobs: list[Job]) -> list[Job]:
        """Queued jobs say so when their device has no live worker, a data-parallel one what it waits
        for (core/gangs/policy.waiting_note): read live, never stale."""
        queued = [job for job in jobs if job.status is JobStatus.queued]
        if not queued:
            return jobs
        live = self.live()
        gangs = GangRecords(self.redis)
        slots = slot_states(self.redis, [d.id for d in live]) if any(job.world_size > 1 for job in queued) else {}
        for job in queued:
            if job.world_size > 1:  # a gang: a training job
                params = TrainingParams.of(job)
                job.message = waiting_note(job, params.world_size, params.elastic, gangs.read(job.id), live, slots)
                continue
            note = self.waiting_note(job.requested_device, live)
            if note:
                job.message = f"{note} ({job.message})" if job.message else note
        return jobs

    def validate_request(self, requested: str) -> str:
        """A job's `device`: auto, cuda, cpu, or the id of a device a worker has registered."""
        if requested in ("auto", "cuda", "cpu") or requested in self.known_ids():
            return requested
        known = ", ".join(sorted(self.known_ids())) or "none registered yet"
        raise InvalidInput(f"unknown device {requested!r}: use auto, cuda, cpu or a device id ({known})")
