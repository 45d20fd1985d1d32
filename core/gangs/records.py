"""A gang's record in Redis: what the ranks of one attempt of a data-parallel job share.

A job with `world_size` N > 1 runs as N ranks, one per worker, trained together through
torch.distributed (worker/gang/member.py, worker/gang/training.py). The scheduler (core/gangs/scheduler.py)
reserves N devices' slots (core/devices/slots.py) and writes this record in the same script:

- **The gang record** (`ty:gang:<job>`): the attempt id (a fresh one per reservation), the
  delivery token it serves, its ranks, rank 0's rendezvous address once rank 0 claimed the job
  and the secret under which the ranks' keys live in that store (never shown by the API),
  the ranks that are ready, the last epoch rank 0 recorded, and the first failure a rank
  reported. Every write checks the attempt id inside its script: a rank of an older attempt
  (frozen, then woken) writes nothing. Rank 0 writes the job itself, through the job's fenced
  delivery (core/jobs/delivery.py) as any single-device job does; the other ranks never write the job.
- **The waiting set** (`ty:gangs:waiting`): where a gang job's deliveries go instead of a
  Celery queue (core/queue.dispatcher), oldest job first; `ty:gangs:reserved` the reservations
  rank 0 has not started yet, by when they lapse.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

import redis

from core import keys
from core.gangs.policy import RECORD_TTL_S


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
                                args=[attempt, job_id, address, RECORD_TTL_S, secret]))

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
