"""Device slots (`ty:device:<id>:slot`): what each device's worker is doing, for the gangs.

A worker marks its slot `busy` when it starts any task (`DeviceSlots.take_for_job`) and frees it
when the task ends; the gang scheduler (core/gangs/scheduler.py) marks the slots of N free, live
devices `reserved` for one data-parallel job's ranks in ONE Lua script, or none of them. So two
gang jobs never each hold half of what they need (no deadlock), and a device reserved for a rank
is not taken by a single-device job: a worker that receives one there gives it back to its queue
(it ran nothing) and takes its rank's message next. A reservation lapses after its deadline
(Redis time) if rank 0 has not started the job by then; a joined rank notices and frees its slot.
While the oldest gang waits, the devices it will need are `held` for it (free ones at once, busy
ones through a promise on their slot that the task's own release turns into the hold), so a
backlog of single-device jobs cannot starve it: core/gangs/policy.py decides which, and when a
held device may still start a single-device job; the scripts below enforce it.

A slot's fields: `state` (busy, reserved, held; absent: free), `job` and `token` (the task, or the
gang it is reserved or held for), `attempt` and `rank` (a reservation's seat), `deadline` (Redis
time: when a reservation or hold lapses), `entry` (a hold's waiting delivery), and `hold_job`,
`hold_entry`, `hold_deadline` (a busy or reserved slot promised to a waiting gang).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import redis

from core import keys


class GangSeat(Protocol):
    """What a slot needs of a gang's seat (core/gangs/records.Seat): the rank and its attempt."""

    @property
    def rank(self) -> int: ...

    @property
    def attempt(self) -> str: ...


class SlotState(NamedTuple):
    """A taken slot, as the API and the ranks read it (`slot_states`)."""

    state: str  # reserved, held or busy
    job: str  # the job it is reserved or held for, or busy with
    promised: str = ""  # busy or reserved: the gang job it is held for once its task ends


# A task is starting on this device (KEYS: slot, waiting set): refused (0) while the slot is reserved for
# a gang's rank, or held for a gang that still waits (core/gangs/policy.single_may_start), until that
# lapses; else marked busy with job ARGV[1], token ARGV[2].
_TAKE_FOR_JOB = """
redis.replicate_commands()
local s = redis.call('HMGET', KEYS[1], 'state', 'deadline', 'entry')
if s[1] == 'reserved' or s[1] == 'held' then
  local t = redis.call('TIME')
  if tonumber(t[1]) + tonumber(t[2]) / 1000000 < tonumber(s[2]) then
    if s[1] == 'reserved' or (s[3] and redis.call('ZSCORE', KEYS[2], s[3])) then return 0 end
  end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'state', 'busy', 'job', ARGV[1], 'token', ARGV[2])
return 1
"""

# What a slot whose task is over becomes (KEYS[1] slot, KEYS[2] waiting set): held for the gang it was
# promised to, if that promise stands (its deadline, Redis time, and its gang still waits); else free.
_FREE_OR_HOLD = """
local function free_or_hold()
  local p = redis.call('HMGET', KEYS[1], 'hold_job', 'hold_entry', 'hold_deadline')
  redis.call('DEL', KEYS[1])
  if not p[2] or not redis.call('ZSCORE', KEYS[2], p[2]) then return 1 end
  local t = redis.call('TIME')
  if tonumber(t[1]) + tonumber(t[2]) / 1000000 >= tonumber(p[3]) then return 1 end
  redis.call('HSET', KEYS[1], 'state', 'held', 'job', p[1], 'entry', p[2], 'deadline', p[3])
  return 2
end
"""

# A rank's message arrived (KEYS: slot, gang): take the slot only if it is reserved for exactly this
# job, attempt and rank, and the gang record is still that attempt's. ARGV: job, token, attempt, rank.
_JOIN = """
local s = redis.call('HMGET', KEYS[1], 'state', 'job', 'token', 'attempt', 'rank')
if s[1] ~= 'reserved' or s[2] ~= ARGV[1] or s[3] ~= ARGV[2] or s[4] ~= ARGV[3] or s[5] ~= ARGV[4] then
  return 0
end
if redis.call('HGET', KEYS[2], 'attempt') ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'busy')
return 1
"""

# The task ended: free the slot (or hold it, _FREE_OR_HOLD) if it is still this task's: job ARGV[1],
# token ARGV[2], attempt ARGV[3] ('' for a single-device job). KEYS: slot, waiting set.
_RELEASE = """
redis.replicate_commands()
""" + _FREE_OR_HOLD + """
local s = redis.call('HMGET', KEYS[1], 'job', 'token', 'attempt')
if s[1] == ARGV[1] and s[2] == ARGV[2] and (s[3] or '') == ARGV[3] then return free_or_hold() end
return 0
"""

# A fresh worker process on this device: whatever its predecessor was busy with is over.
_RESET = """
redis.replicate_commands()
""" + _FREE_OR_HOLD + """
if redis.call('HGET', KEYS[1], 'state') == 'busy' then return free_or_hold() end
return 1
"""


class DeviceSlots:
    """A worker's own device slot: taken when a task starts, freed when it ends (module docstring)."""

    def __init__(self, client: redis.Redis, device_id: str) -> None:
        self.redis = client
        self.key = keys.device_slot(device_id)
        self._take = client.register_script(_TAKE_FOR_JOB)
        self._join = client.register_script(_JOIN)
        self._release = client.register_script(_RELEASE)
        self._reset = client.register_script(_RESET)

    def reset(self) -> None:
        """At start: a predecessor's `busy` is over (held, if it was promised to a waiting gang); a
        reservation stands (its rank's message waits)."""
        self._reset(keys=[self.key, keys.GANGS_WAITING])

    def take_for_job(self, job_id: str, token: str) -> bool:
        """Mark the device busy with a single-device job; False while it is reserved for a gang's rank
        or held for a waiting gang."""
        return bool(self._take(keys=[self.key, keys.GANGS_WAITING], args=[job_id, token]))

    def join(self, job_id: str, token: str, seat: GangSeat) -> bool:
        """Take the slot reserved for this rank; False for a message of a lapsed or other attempt."""
        return bool(self._join(keys=[self.key, keys.gang(job_id)], args=[job_id, token, seat.attempt, seat.rank]))

    def release(self, job_id: str, token: str, attempt: str = "") -> None:
        """The task ended: the device is free, or held for the waiting gang it was promised to."""
        self._release(keys=[self.key, keys.GANGS_WAITING], args=[job_id, token, attempt])

    def state(self) -> dict[str, str]:
        return self.redis.hgetall(self.key)


def slot_states(client: redis.Redis, devices: list[str]) -> dict[str, SlotState]:
    """Each device's slot that is taken: reserved, held or busy (absent: free)."""
    pipe = client.pipeline(transaction=False)
    for device in devices:
        pipe.hmget(keys.device_slot(device), "state", "job", "hold_job")
    return {device: SlotState(state, job or "", promised or "")
            for device, (state, job, promised) in zip(devices, pipe.execute(), strict=True) if state}
