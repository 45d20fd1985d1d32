"""The gang scheduler: reserve every rank of a data-parallel job at once, or none, and send the ranks.

Run from every live worker's heartbeat (one worker at a time, a short Redis lock), so a gang job
starts within a beat of enough devices being free, whichever worker freed them. One pass:

1. Reservations that lapsed (rank 0 never claimed the job before the deadline, on Redis's clock:
   a rank's worker died or never took its message) are undone: their still-reserved slots are
   freed and the job waits again. Ranks that had joined see the attempt gone and free their own.
2. The waiting deliveries (`ty:gangs:waiting`), oldest job first: for each, the live devices of
   its type, packed by host (hosts with the most candidates first: fewer ranks talk across
   hosts), rank 0's device first when the job named one, go to ONE Lua script that checks each
   device is alive and free and reserves `world_size` of them, or nothing. How many it needs
   (an elastic job resuming after a fault takes as many as are free, from 1 up) and which type
   (`auto`: GPUs when enough GPU workers are live, else CPUs, never a mix) are the policy's
   (core/gangs/policy.py `devices_needed`, `device_type_for`).
3. For a reservation made, one `torchyard.train(job, token, seat)` message per rank, on each
   device's own queue (core/queue.py).

A job that cannot be placed now waits. So that a backlog of single-device jobs cannot starve it,
the OLDEST gang that waits and fits the live devices (and only it: two waiting gangs never hold
devices at once, so they cannot block each other) holds the devices it will use, as
core/gangs/policy.py decides: the free ones at once, and, while those are too few, every busy one
of its type for when its task ends (the task's release turns that promise into the hold, so the
next single-device job in the queue does not take it). A worker whose device is held gives a
single-device job back to its queue; the gang starts at the first pass after enough of its
devices are free. Holds last `HOLD_S` unless a pass renews them, and bind nobody once their gang
no longer waits; a gang placed lets go at once of the ones it does not use. A younger, smaller
gang still starts on free devices nobody holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis

from core import keys
from core.access import holds
from core.access.projects import project_of
from core.clock import redis_now
from core.gangs.policy import (
    HOLD_S,
    RECORD_TTL_S,
    SCHEDULER_LOCK_MS,
    WAITING_BATCH,
    Holder,
    device_type_for,
    devices_needed,
    hold_plan,
    placement_order,
    read_slot,
)
from core.gangs.records import Seat, new_attempt, parse_gang
from core.kinds.train.params import TrainingParams
from core.queue import Dispatch, TrainDelivery, gang_request, queue_for_device
from core.schemas import Device, JobStatus

log = logging.getLogger(__name__)

# KEYS: job hash, gang hash, waiting set, reserved set, then per candidate its slot and alive keys.
# ARGV: task id, token, attempt, want, least, reservation seconds, job id, pinned ("1": candidate 1 must
# be rank 0), the record's TTL, then per candidate its device id and worker name.
# A slot is free when empty, when its reservation or hold lapsed, when it is held for this job, or held
# for a gang that no longer waits. Returns {1, i1, i2, ...} (the candidates reserved, in rank order;
# this job's holds on the others are let go); {0, free} when fewer than `least` are free (nothing
# changed); {-1} when the delivery is stale, {-2} when already reserved.
_RESERVE = """
redis.replicate_commands()
local job = redis.call('HMGET', KEYS[1], 'status', 'delivery')
if job[1] ~= 'queued' or job[2] ~= ARGV[2] then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return {-1}
end
if redis.call('HGET', KEYS[2], 'token') == ARGV[2] then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return {-2}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local want, least = tonumber(ARGV[4]), tonumber(ARGV[5])
local free = {}
for i = 1, (#KEYS - 4) / 2 do
  if redis.call('EXISTS', KEYS[4 + 2 * i]) == 1 then
    local s = redis.call('HMGET', KEYS[3 + 2 * i], 'state', 'deadline', 'job', 'entry')
    local lapsed = s[2] and tonumber(s[2]) < now
    local void = s[1] == 'held' and not (s[4] and redis.call('ZSCORE', KEYS[3], s[4]))
    if (not s[1]) or ((s[1] == 'reserved' or s[1] == 'held') and lapsed) or (s[1] == 'held' and s[3] == ARGV[7])
        or void then
      free[#free + 1] = i
    end
  end
end
local chosen = {}
for n, i in ipairs(free) do if n <= want then chosen[n] = i end end
if #chosen < least or (ARGV[8] == '1' and chosen[1] ~= 1) then return {0, #free} end
local deadline = string.format('%.6f', now + tonumber(ARGV[6]))
local members = {}
local taken = {}
for rank0, i in ipairs(chosen) do
  local slot = KEYS[3 + 2 * i]
  taken[i] = true
  redis.call('DEL', slot)
  redis.call('HSET', slot, 'state', 'reserved', 'job', ARGV[7], 'token', ARGV[2], 'attempt', ARGV[3],
             'rank', rank0 - 1, 'deadline', deadline)
  members[rank0] = {rank = rank0 - 1, device = ARGV[8 + 2 * i], worker = ARGV[9 + 2 * i]}
end
for i = 1, (#KEYS - 4) / 2 do  -- what it held and does not use is free again
  if not taken[i] then
    local slot = KEYS[3 + 2 * i]
    local s = redis.call('HMGET', slot, 'state', 'entry', 'hold_entry')
    if s[1] == 'held' and s[2] == ARGV[1] then redis.call('DEL', slot)
    elseif s[3] == ARGV[1] then redis.call('HDEL', slot, 'hold_job', 'hold_entry', 'hold_deadline') end
  end
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'attempt', ARGV[3], 'token', ARGV[2], 'state', 'reserved', 'deadline', deadline,
           'members', cjson.encode(members))
redis.call('EXPIRE', KEYS[2], ARGV[9])
redis.call('ZADD', KEYS[4], deadline, ARGV[7])
redis.call('ZREM', KEYS[3], ARGV[1])
local out = {1}
for _, i in ipairs(chosen) do out[#out + 1] = i end
return out
"""

# Apply a pass's hold plan (core/gangs/policy.hold_plan). KEYS: then the slots of the devices named.
# ARGV: the holder's waiting delivery, its job id, hold seconds, then per slot 'hold' or 'drop'. A hold
# makes a free slot (or one whose reservation lapsed, or held by anyone) held for the holder; a slot
# busy with a task, or reserved for a rank, is promised to it instead (its release holds it).
_HOLD = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local until_ = string.format('%.6f', now + tonumber(ARGV[3]))
for i = 1, #KEYS do
  local s = redis.call('HMGET', KEYS[i], 'state', 'deadline')
  if ARGV[3 + i] == 'hold' then
    if (not s[1]) or s[1] == 'held' or (s[1] == 'reserved' and tonumber(s[2]) < now) then
      redis.call('DEL', KEYS[i])
      redis.call('HSET', KEYS[i], 'state', 'held', 'job', ARGV[2], 'entry', ARGV[1], 'deadline', until_)
    else
      redis.call('HSET', KEYS[i], 'hold_job', ARGV[2], 'hold_entry', ARGV[1], 'hold_deadline', until_)
    end
  elseif s[1] == 'held' then
    redis.call('DEL', KEYS[i])
  else
    redis.call('HDEL', KEYS[i], 'hold_job', 'hold_entry', 'hold_deadline')
  end
end
return 1
"""

# Undo a reservation that lapsed. KEYS: gang, reserved set, waiting set, job hash, then the slots of
# its members. ARGV: job id, attempt. Slots still reserved for the attempt are freed (joined ones are
# their ranks' to free); the job waits again if it is still queued under the gang's token.
_LAPSE = """
redis.replicate_commands()
local g = redis.call('HMGET', KEYS[1], 'attempt', 'state', 'deadline', 'token')
if g[1] ~= ARGV[2] or g[2] ~= 'reserved' then redis.call('ZREM', KEYS[2], ARGV[1]) return 0 end
local t = redis.call('TIME')
if tonumber(t[1]) + tonumber(t[2]) / 1000000 < tonumber(g[3]) then return 0 end
local job = redis.call('HMGET', KEYS[4], 'status', 'delivery')
if job[1] == 'running' and job[2] == g[4] then redis.call('ZREM', KEYS[2], ARGV[1]) return 0 end
for i = 5, #KEYS do
  local s = redis.call('HMGET', KEYS[i], 'state', 'attempt')
  if s[1] == 'reserved' and s[2] == ARGV[2] then redis.call('DEL', KEYS[i]) end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if job[1] == 'queued' and job[2] == g[4] then redis.call('ZADD', KEYS[3], 0, ARGV[1] .. '.' .. g[4]) end
return 1
"""


_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


@dataclass(frozen=True)
class Waits:
    """A gang that fits the live devices but waits for enough of them to be free."""

    holder: Holder
    candidates: list[str]  # the live devices of its type, in placement order


class GangScheduler:
    def __init__(self, client: redis.Redis, dispatch: Dispatch, devices: Callable[[], list[Device]], *,
                 reservation_s: float, hold_s: float = HOLD_S, instance: str = "") -> None:
        self.redis = client
        self.dispatch = dispatch
        self.devices = devices  # every device's last heartbeat record (core/devices/registry.DeviceRegistry.all)
        self.reservation_s = reservation_s
        self.hold_s = hold_s
        self.instance = instance or new_attempt()
        self._reserve = client.register_script(_RESERVE)
        self._lapse = client.register_script(_LAPSE)
        self._unlock = client.register_script(_UNLOCK)
        self._hold = client.register_script(_HOLD)

    def run_once(self) -> list[str]:
        """One pass (module docstring); the jobs reserved. Cheap when nothing waits (two ZCARDs)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zcard(keys.GANGS_WAITING)
        pipe.zcard(keys.GANGS_RESERVED)
        waiting, reserved = pipe.execute()
        if not waiting and not reserved:
            return []
        if not self.redis.set(keys.GANGS_LOCK, self.instance, nx=True, px=SCHEDULER_LOCK_MS):
            return []  # another worker's pass (their reservations are atomic anyway: this only saves work)
        try:
            if reserved:
                self._undo_lapsed(redis_now(self.redis))
            placed: list[str] = []
            entries = self.redis.zrange(keys.GANGS_WAITING, 0, WAITING_BATCH - 1) if waiting else []
            devices = [d for d in self.devices() if d.status in ("idle", "busy")] if entries else []
            holding = False  # only the oldest gang that has to wait holds devices
            for entry in entries:
                outcome = self._place(entry, devices)
                if isinstance(outcome, Waits) and not holding:
                    self._apply_holds(outcome, devices)
                    holding = True
                elif outcome == "placed":
                    placed.append(entry.partition(".")[0])
            if entries and not holding:
                self._apply_holds(None, devices)  # nobody fits: whatever is held is let go
            return placed
        finally:
            self._unlock(keys=[keys.GANGS_LOCK], args=[self.instance])

    def resend(self, job_id: str, token: str) -> None:
        """A worker whose device was reserved for a gang refused this single-device delivery: send it
        again, so another worker (or this one after its rank) takes it."""
        status, delivery, queue = self.redis.hmget(keys.job(job_id), "status", "delivery", "queue")
        if status == JobStatus.queued.value and delivery == token and queue:
            self.dispatch(TrainDelivery(job_id, token, queue))

    def _place(self, entry: str, live: list[Device]) -> str | Waits:
        """placed; Waits (it fits the live devices once enough are free); or skipped (stale, or too few
        live devices of its type: it waits for workers, holding nothing)."""
        job_id, _, token = entry.partition(".")
        status, queue, raw_params, attempts = self.redis.hmget(keys.job(job_id), "status", "queue", "params",
                                                               "attempts")
        if status != JobStatus.queued.value or not queue:
            self.redis.zrem(keys.GANGS_WAITING, entry)
            return "skipped"
        if self._held_for_quota(job_id):
            return "skipped"  # its project is at a quota that holds starts: it waits, holding nothing
        params = TrainingParams.model_validate_json(raw_params or "{}")  # a gang is a training job
        world_size = params.world_size
        least = devices_needed(world_size, params.elastic, int(attempts or 0) > 0)
        requested = gang_request(queue)
        pinned = next((d for d in live if d.id == requested), None)
        kind = device_type_for(requested, live, least)
        if kind is None or sum(d.type == kind for d in live) < least:
            return "skipped"  # too few live devices of its type, or rank 0's device is offline: it waits
        candidates = placement_order([d for d in live if d.type == kind], pinned.id if pinned else None)
        attempt = new_attempt()
        slot_keys = [k for d in candidates for k in (keys.device_slot(d.id), keys.device_alive(d.id))]
        names = [v for d in candidates for v in (d.id, d.worker)]
        result = self._reserve(
            keys=[keys.job(job_id), keys.gang(job_id), keys.GANGS_WAITING, keys.GANGS_RESERVED, *slot_keys],
            args=[entry, token, attempt, world_size, least, self.reservation_s, job_id, "1" if pinned else "0",
                  RECORD_TTL_S, *names])
        if result[0] < 0:
            return "skipped"
        if result[0] == 0:
            return Waits(Holder(entry, job_id, least, pinned.id if pinned else None), [d.id for d in candidates])
        self._send_ranks(job_id, token, attempt, [candidates[i - 1] for i in result[1:]])
        return "placed"

    def _held_for_quota(self, job_id: str) -> bool:
        """Whether the job's project is at running_jobs, devices_held (its ranks count) or
        device_seconds_per_day (core/access/holds.py); its job's message says so. Checked again,
        atomically, by rank 0's claim."""
        project_field, raw_params, message = self.redis.hmget(keys.job(job_id), "project", "params", "message")
        project = project_of(project_field)
        limits = holds.read_limits(self.redis, project)
        reason = None
        if limits:
            now = redis_now(self.redis)
            reason = holds.hold_reason(limits, holds.usage(self.redis, project, now), project,
                                       holds.devices_of({"params": raw_params}), now)
        if reason is not None:
            self.redis.hset(keys.job(job_id), "message", reason)
        elif message and message.startswith(holds.HELD_PREFIX):  # room again: its note is the devices' now
            self.redis.hset(keys.job(job_id), "message", "queued: its project has room again")
        return reason is not None

    def _apply_holds(self, waits: Waits | None, live: list[Device]) -> None:
        """Hold for the oldest waiting gang what core/gangs/policy.hold_plan says, and let go of every
        other hold; one read of the live devices' slots, one script."""
        ids = [d.id for d in live]
        now, raws = self._read_slots(ids)
        mentioned = sorted({e for raw in raws for e in (raw.get("entry"), raw.get("hold_entry")) if e})
        scores = self.redis.zmscore(keys.GANGS_WAITING, mentioned) if mentioned else []
        waiting = {e for e, score in zip(mentioned, scores, strict=True) if score is not None}
        views = {device: read_slot(device, raw, now, waiting) for device, raw in zip(ids, raws, strict=True)}
        candidates = [views[d] for d in waits.candidates] if waits is not None else []
        plan = hold_plan(waits.holder if waits is not None else None, candidates, list(views.values()))
        if not plan:
            return
        named = list(plan)
        holder = waits.holder if waits is not None else Holder("", "", 0)
        self._hold(keys=[keys.device_slot(d) for d in named],
                   args=[holder.entry, holder.job, self.hold_s, *(plan[d] for d in named)])

    def _read_slots(self, devices: list[str]) -> tuple[float, list[dict[str, str]]]:
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        for device in devices:
            pipe.hgetall(keys.device_slot(device))
        (seconds, micros), *raws = pipe.execute()
        return seconds + micros / 1_000_000, raws

    def _send_ranks(self, job_id: str, token: str, attempt: str, members: list[Device]) -> None:
        log.info("job %s: reserved %s for its gang (attempt %s)", job_id, ", ".join(d.id for d in members), attempt)
        for rank, device in enumerate(members):
            try:
                self.dispatch(TrainDelivery(job_id, token, queue_for_device(device.id), seat=Seat(rank, attempt).encode()))
            except Exception as exc:  # the reservation lapses and the job waits again
                log.warning("job %s: sending rank %d to %s failed (%s); its reservation will lapse", job_id, rank,
                            device.id, exc)

    def _undo_lapsed(self, now: float) -> None:
        for job_id in self.redis.zrangebyscore(keys.GANGS_RESERVED, "-inf", now, start=0, num=WAITING_BATCH):
            raw = self.redis.hgetall(keys.gang(job_id))
            gang = parse_gang(raw) if raw else None
            slots = [keys.device_slot(m.device) for m in gang.members] if gang else []
            if self._lapse(keys=[keys.gang(job_id), keys.GANGS_RESERVED, keys.GANGS_WAITING, keys.job(job_id), *slots],
                           args=[job_id, gang.attempt if gang else ""]):
                log.warning("job %s: its gang's reservation lapsed before rank 0 started it; it waits again", job_id)
