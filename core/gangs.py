"""Data-parallel jobs' gangs in Redis: what each device is doing, and the record a gang's ranks share.

A job with `world_size` N > 1 runs as N ranks, one per worker, trained together through
torch.distributed (worker/gang.py, worker/gang_training.py). Three records make that safe:

- **Device slots** (`ty:device:<id>:slot`): what the device's worker is doing. A worker marks its
  slot `busy` when it starts any task (`DeviceSlots.take_for_job`) and frees it when the task
  ends; the gang scheduler (core/gang_scheduler.py) marks the slots of N free, live devices
  `reserved` for one gang in ONE Lua script, or none of them. So two gang jobs never each hold
  half of what they need (no deadlock), and a device reserved for a rank is not taken by a
  single-device job: a worker that receives one there gives it back to its queue (it ran
  nothing) and takes its rank's message next. A reservation lapses after its deadline (Redis
  time) if rank 0 has not started the job by then; a joined rank notices and frees its slot.
  While the oldest gang waits, the devices it will need are `held` for it (free ones at once,
  busy ones through a promise on their slot that the task's own release turns into the hold), so
  a backlog of single-device jobs cannot starve it: core/gang_policy.py decides which, and when a
  held device may still start a single-device job; the scripts below enforce it.
- **The gang record** (`ty:gang:<job>`): the attempt id (a fresh one per reservation), the
  delivery token it serves, its ranks, rank 0's rendezvous address once rank 0 claimed the job
  and the secret under which the ranks' keys live in that store (never shown by the API),
  the ranks that are ready, the last epoch rank 0 recorded, and the first failure a rank
  reported. Every write checks the attempt id inside its script: a rank of an older attempt
  (frozen, then woken) writes nothing. Rank 0 writes the job itself, through the job's fenced
  delivery (core/jobs/delivery.py) as any single-device job does; the other ranks never write the job.
- **The waiting set** (`ty:gangs:waiting`): where a gang job's deliveries go instead of a
  Celery queue (core/queue.dispatcher), oldest job first.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis

from core import keys
from core.errors import InvalidInput
from core.schemas import Device, Job

# A gang record outlives its attempt only by this (its rank 0 died, nobody reserved the job again).
GANG_RECORD_TTL_S = 7 * 24 * 3600


@dataclass(frozen=True)
class Seat:
    """Rank `rank` of gang attempt `attempt`: the third argument of a rank's train message."""

    rank: int
    attempt: str

    def encode(self) -> str:
        return f"{self.rank}.{self.attempt}"

    @classmethod
    def parse(cls, raw: str) -> Seat:
        rank, _, attempt = raw.partition(".")
        if not rank.isdigit() or not attempt:
            raise ValueError(f"not a gang seat: {raw!r}")
        return cls(int(rank), attempt)


@dataclass(frozen=True)
class Member:
    rank: int
    device: str
    worker: str


class SlotState(NamedTuple):
    """A taken slot, as the API and the ranks read it (GangRecords.slot_states)."""

    state: str  # reserved, held or busy
    job: str  # the job it is reserved or held for, or busy with
    promised: str = ""  # busy or reserved: the gang job it is held for once its task ends


@dataclass(frozen=True)
class GangState:
    """One read of a gang record (GangRecords.read)."""

    attempt: str
    token: str
    members: list[Member]
    running: bool  # rank 0 claimed the job and published its rendezvous address
    address: str | None  # "<host>:<port>" of rank 0's store
    secret: str | None = field(default=None, repr=False)  # the attempt's namespace in that store
    ready: set[int] = field(default_factory=set)
    epoch: int = 0  # the last epoch rank 0 recorded in the job
    failure: str | None = None  # why the first rank that failed left
    fatal: bool = False  # that failure would recur on any devices: the job fails (else it is requeued)

    @property
    def world_size(self) -> int:
        return len(self.members)


def new_attempt() -> str:
    return secrets.token_hex(6)


# A task is starting on this device (KEYS: slot, waiting set): refused (0) while the slot is reserved for
# a gang's rank, or held for a gang that still waits (core/gang_policy.single_may_start), until that
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

# Rank 0 claimed the job: the gang runs, and its store listens at ARGV[3]. KEYS: gang, reserved set.
# ARGV: attempt, job id, address, the record's TTL, the attempt's secret.
_START = """
local g = redis.call('HMGET', KEYS[1], 'attempt', 'state')
if g[1] ~= ARGV[1] or g[2] ~= 'reserved' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'running', 'address', ARGV[3], 'secret', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""

# Set field ARGV[2] to ARGV[3] in the gang record (KEYS[1]) if it is still attempt ARGV[1]; with
# ARGV[4] == 'first', only if the field is not set yet (the first failure is the one to report).
_SET_FIELD = """
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 0 end
if ARGV[4] == 'first' and redis.call('HEXISTS', KEYS[1], ARGV[2]) == 1 then return 1 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
"""

_END = """
if redis.call('HGET', KEYS[1], 'attempt') == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
return 0
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

    def join(self, job_id: str, token: str, seat: Seat) -> bool:
        """Take the slot reserved for this rank; False for a message of a lapsed or other attempt."""
        return bool(self._join(keys=[self.key, keys.gang(job_id)], args=[job_id, token, seat.attempt, seat.rank]))

    def release(self, job_id: str, token: str, attempt: str = "") -> None:
        """The task ended: the device is free, or held for the waiting gang it was promised to."""
        self._release(keys=[self.key, keys.GANGS_WAITING], args=[job_id, token, attempt])

    def state(self) -> dict[str, str]:
        return self.redis.hgetall(self.key)


class GangRecords:
    """Reads and attempt-fenced writes of gang records, by their ranks and by the API."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._start = client.register_script(_START)
        self._set = client.register_script(_SET_FIELD)
        self._end = client.register_script(_END)

    def read(self, job_id: str) -> GangState | None:
        raw = self.redis.hgetall(keys.gang(job_id))
        return parse_gang(raw) if raw else None

    def start(self, job_id: str, attempt: str, address: str, secret: str) -> bool:
        """Rank 0, after claiming the job: the gang runs, its store listens at `address`, the ranks'
        keys live under `secret` there."""
        return bool(self._start(keys=[keys.gang(job_id), keys.GANGS_RESERVED],
                                args=[attempt, job_id, address, GANG_RECORD_TTL_S, secret]))

    def ready(self, job_id: str, seat: Seat) -> bool:
        """This rank has its data, model and plan: it joins the process group once all are ready."""
        return self._write(job_id, seat.attempt, f"ready:{seat.rank}", "1")

    def record_epoch(self, job_id: str, attempt: str, epoch: int) -> bool:
        """Rank 0 recorded `epoch` in the job (metrics and resume state): the others go on past it."""
        return self._write(job_id, attempt, "epoch", str(epoch))

    def fail(self, job_id: str, seat: Seat, device: str, message: str, *, fatal: bool = False) -> bool:
        """Why this rank left the gang: rank 0 fails the job with the first such reason when `fatal`,
        else gives it back to the queue with it."""
        doc = {"message": f"rank {seat.rank} on {device}: {message}"[:1000], "fatal": fatal}
        return self._write(job_id, seat.attempt, "failure", json.dumps(doc), first=True)

    def end(self, job_id: str, attempt: str) -> None:
        """Rank 0's attempt is over (the job ended or went back to the queue)."""
        self._end(keys=[keys.gang(job_id)], args=[attempt])

    def alive(self, devices: list[str]) -> list[bool]:
        """Whether each device's worker still renews its heartbeat (its alive key)."""
        pipe = self.redis.pipeline(transaction=False)
        for device in devices:
            pipe.exists(keys.device_alive(device))
        return [bool(n) for n in pipe.execute()]

    def slot_states(self, devices: list[str]) -> dict[str, SlotState]:
        """Each device's slot that is taken: reserved, held or busy (absent: free)."""
        pipe = self.redis.pipeline(transaction=False)
        for device in devices:
            pipe.hmget(keys.device_slot(device), "state", "job", "hold_job")
        return {device: SlotState(state, job or "", promised or "")
                for device, (state, job, promised) in zip(devices, pipe.execute(), strict=True) if state}

    def _write(self, job_id: str, attempt: str, name: str, value: str, *, first: bool = False) -> bool:
        return bool(self._set(keys=[keys.gang(job_id)], args=[attempt, name, value, "first" if first else ""]))


def parse_gang(raw: dict[str, str]) -> GangState:
    members = [Member(int(m["rank"]), m["device"], m["worker"]) for m in json.loads(raw.get("members") or "[]")]
    failure = json.loads(raw["failure"]) if raw.get("failure") else {}
    return GangState(
        attempt=raw.get("attempt", ""), token=raw.get("token", ""), members=sorted(members, key=lambda m: m.rank),
        running=raw.get("state") == "running", address=raw.get("address") or None, secret=raw.get("secret") or None,
        ready={int(name.split(":", 1)[1]) for name in raw if name.startswith("ready:")},
        epoch=int(raw.get("epoch") or 0), failure=failure.get("message"), fatal=bool(failure.get("fatal")))


# ---------------------------------------------------------------------------- the API's side
def gang_kind(requested: str, devices: list[Device]) -> str | None:
    """The device type a gang for `requested` runs on: cuda or cpu as asked, a device id's type, or
    for auto None (the scheduler takes whichever type has enough free devices, GPUs first)."""
    if requested in ("cuda", "cpu"):
        return requested
    if requested == "auto":
        return None
    return next((d.type for d in devices if d.id == requested), None)


def check_world_size(world_size: int, requested: str, devices: list[Device]) -> None:
    """Refuse at submit a gang larger than the devices of its type that exist (live or not)."""
    if world_size <= 1:
        return
    kind = gang_kind(requested, devices)
    kinds = [kind] if kind else ["cuda", "cpu"]
    counts = {k: [d.id for d in devices if d.type == k] for k in kinds}
    best = max(kinds, key=lambda k: len(counts[k]))
    if len(counts[best]) < world_size:
        which = "GPU" if best == "cuda" else "CPU"
        listed = ", ".join(sorted(counts[best])) or "none"
        raise InvalidInput(f"world_size {world_size} needs {world_size} {which} devices, one worker each; "
                           f"{len(counts[best])} exist ({listed}). Ask for at most {len(counts[best]) or 1}, "
                           f"or start more workers")


def waiting_note(job: Job, gang: GangState | None, live: list[Device], slots: dict[str, SlotState]) -> str:
    """What a queued gang job waits for, from the live devices and their slots (read, never stored)."""
    if gang is not None and gang.token and not gang.running:
        ranks = ", ".join(f"{m.device} (rank {m.rank})" for m in gang.members)
        return f"starting: {ranks} reserved for it"
    params: dict[str, Any] = job.params
    need = int(params.get("world_size") or 1)
    least = 1 if params.get("elastic") and job.attempts else need
    kind = gang_kind(job.requested_device, live)
    eligible = [d for d in live if kind is None or d.type == kind]
    idle = sorted(d.id for d in eligible if d.id not in slots)
    held = sorted(d.id for d in eligible if d.id in slots and slots[d.id].state == "held" and slots[d.id].job == job.id)
    promised = sorted(d.id for d in eligible if d.id in slots and slots[d.id].promised == job.id)
    what = "GPU" if kind == "cuda" else "CPU" if kind == "cpu" else ""
    wanted = f"{least} to {need}" if least < need else f"{need}"
    pinned = f"; rank 0 on {job.requested_device}" if kind and job.requested_device not in ("cuda", "cpu") else ""
    note = (f"waiting for {wanted} free {what + ' ' if what else ''}workers at once (world_size {need}{pinned}); "
            f"free now: {len(idle)}{' (' + ', '.join(idle) + ')' if idle else ''} of {len(eligible)} live")
    note += f"; holding {', '.join(held)} for it" if held else ""
    return note + (f"; then {', '.join(promised)} once the job running there ends" if promised else "")
