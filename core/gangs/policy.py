"""The gang policy: every rule of data-parallel scheduling, pure (no Redis, no I/O), in one place.

The gang scheduler (core/gangs/scheduler.py) reads the device slots, asks these functions, and
applies the answer in one Lua script; the slot scripts of core/devices/slots.py enforce the same
rules atomically when a worker starts or ends a task (`single_may_start` and `read_slot` are their
twins, and tests/core/devices/test_slots.py checks that both agree). The API asks the same rules
at submit (`check_world_size`) and when it shows a queued gang job (`waiting_note`); the worker's
ranks (worker/gang/member.py) read their timings here.

The rules:

- **How many devices.** A gang starts on `world_size` devices, all at once; an elastic job that a
  fault ended resumes on as many as are free, at least one (`devices_needed`).
- **Which device type.** `cuda` or `cpu` as asked, the type of the device a job named for rank 0,
  and for `auto` GPUs when enough GPU workers are there, else CPUs; never a mix (`device_type_for`).
- **Who holds.** Only the oldest waiting gang that fits the live devices of its type (its
  "holder" here), so two waiting gangs never block each other; a gang larger than the live
  devices of its type holds nothing. Every other hold is dropped by the pass that sees it.
- **What it holds.** The devices it can have now (free, or held by anyone: only the holder holds),
  up to the number it needs to start (`need`: `devices_needed`), rank 0's device first when the
  job named one, packed by host as the placement is (`placement_order`). While it has fewer than
  that, it also holds every busy device of its type *for when its task ends*: a promise on the
  slot, which the worker's own release turns into a hold, so the next single-device job in the
  queue never takes it; the gang starts as soon as enough of them are free, whichever end first.
- **When a held device may still start a single-device job** (`single_may_start`): when its hold
  lapsed (no scheduler pass renewed it for `HOLD_S`: every worker's heartbeat is gone) or its gang
  no longer waits (placed, cancelled, or given a new delivery). A device reserved for a gang's
  rank takes nothing until the reservation lapses.
- **The bound.** From the first pass that sees it as the holder (each worker's heartbeat runs one),
  no single-device job starts on a device of its type that is busy then, nor on the free ones it
  holds: it starts at the next pass after the first `need` of them are free, that is after the
  tasks running at that first pass, never after a task that started later. A free device it
  holds idles until then and no longer: held devices beyond what it needs are let go when it is
  placed (core/gangs/scheduler.py); a hold nobody renews lapses after `HOLD_S`.
- **The timings**, every one of them below (`HOLD_S` to `RENDEZVOUS_PORTS`); the two an operator
  tunes are Settings' (`lease_ttl_s`, `gang_timeout_s`), read through `reservation_s` and
  `collective_timeout_s`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from core.access.holds import HELD_PREFIX
from core.errors import InvalidInput

if TYPE_CHECKING:
    from core.config import Settings
    from core.devices.slots import SlotState
    from core.schemas import Device, Job

# A device slot's states as a pass reads them (core/devices/slots.py), and what a pass does to one.
FREE, HELD, RESERVED, BUSY = "free", "held", "reserved", "busy"
HOLD, DROP = "hold", "drop"

# --- the timings, all of them ---------------------------------------------------------------
# How long a hold (or a promise) lasts unless a pass renews it: every live worker's heartbeat runs
# a pass, so this only ends holds that nobody renews (the workers are gone).
HOLD_S = 5.0
# A gang record outlives its attempt only by this (its rank 0 died, nobody reserved the job again).
RECORD_TTL_S = 7 * 24 * 3600
# One scheduler pass at a time among the workers: the lock's lifetime, should its holder die.
SCHEDULER_LOCK_MS = 1000
# Waiting deliveries a pass looks at (the oldest first).
WAITING_BATCH = 50
# How often a rank looks at its gang record while it waits (for the others, for rank 0's epoch).
POLL_S = 0.05
# After giving a single-device job back (the device is reserved or held for a gang), before taking
# the next message.
REFUSED_PAUSE_S = 1.0
# A rank still loading its data after this long ends the attempt (the ranks' liveness is watched meanwhile).
READY_TIMEOUT_S = 600.0
# After a collective failed, how long rank 0 looks for the reason a peer recorded.
REASON_GRACE_S = 1.0
# Rank 0's rendezvous store takes the first free port of settings.rendezvous_port + [0, this).
RENDEZVOUS_PORTS = 64


def reservation_s(settings: Settings) -> float:
    """How long a reservation waits for rank 0 to start the job before it lapses: a lease TTL, by
    which a rank whose worker died or never took its message is known to be gone."""
    return settings.lease_ttl_s


def collective_timeout_s(settings: Settings) -> float:
    """How long a rank waits for the others in a collective (and rank 0's store for a rank) before
    the attempt ends: TORCHYARD_GANG_TIMEOUT_S, else a lease TTL."""
    return settings.gang_timeout_s or settings.lease_ttl_s


# --- how many devices, and of which type ------------------------------------------------------
# The device types a gang may run on, in the order an `auto` gang tries them.
DEVICE_TYPES = ("cuda", "cpu")


class Placed(Protocol):
    """What the placement needs of a device (core/schemas.Device has it)."""

    @property
    def id(self) -> str: ...


class Typed(Placed, Protocol):
    """What the device-type rule needs of a device (core/schemas.Device has it)."""

    @property
    def type(self) -> str: ...


P = TypeVar("P", bound=Placed)


class Seated(Protocol):
    """A rank and its device (core/gangs/records.Member)."""

    @property
    def rank(self) -> int: ...

    @property
    def device(self) -> str: ...


class Attempt(Protocol):
    """What the waiting note needs of a gang record (core/gangs/records.GangState)."""

    @property
    def token(self) -> str: ...

    @property
    def running(self) -> bool: ...

    @property
    def members(self) -> Sequence[Seated]: ...


def devices_needed(world_size: int, elastic: bool, delivered_before: bool) -> int:
    """The fewest devices a gang starts on: all `world_size`, except an elastic job that was delivered
    before (a fault ended that attempt), which resumes on as many as are free, from one."""
    return 1 if elastic and delivered_before else world_size


def device_type_for(requested: str, devices: Sequence[Typed], need: int) -> str | None:
    """The device type a gang for `requested` (a job's `device`) runs on, among `devices`: cuda or cpu
    as asked; the type of the device it named for rank 0 (None when that device is not among them);
    for auto, GPUs when at least `need` are there, else CPUs when enough are, else None."""
    if requested in DEVICE_TYPES:
        return requested
    if requested == "auto":
        return next((kind for kind in DEVICE_TYPES if sum(d.type == kind for d in devices) >= need), None)
    return next((d.type for d in devices if d.id == requested), None)


def check_world_size(world_size: int, requested: str, devices: Sequence[Typed]) -> None:
    """Refuse (InvalidInput, a 422) at submit a gang larger than the devices of its type that exist
    (live or not: a worker that is down now may come back)."""
    if world_size <= 1:
        return
    chosen = device_type_for(requested, devices, world_size)
    ids = {kind: sorted(d.id for d in devices if d.type == kind) for kind in DEVICE_TYPES}
    if chosen is not None and len(ids[chosen]) >= world_size:
        return
    best = chosen if chosen is not None else max(DEVICE_TYPES, key=lambda kind: len(ids[kind]))
    which = "GPU" if best == "cuda" else "CPU"
    listed = ", ".join(ids[best]) or "none"
    raise InvalidInput(f"world_size {world_size} needs {world_size} {which} devices, one worker each; "
                       f"{len(ids[best])} exist ({listed}). Ask for at most {len(ids[best]) or 1}, "
                       f"or start more workers")


def waiting_note(job: Job, world_size: int, elastic: bool, gang: Attempt | None, live: Sequence[Device],
                 slots: dict[str, SlotState]) -> str:
    """What a queued gang job waits for, from the live devices and their slots (read, never stored);
    a project's quota first, when the gang scheduler held it for one (core/access/holds.py)."""
    if job.message and job.message.startswith(HELD_PREFIX):
        return job.message
    if gang is not None and gang.token and not gang.running:
        ranks = ", ".join(f"{m.device} (rank {m.rank})" for m in gang.members)
        return f"starting: {ranks} reserved for it"
    least = devices_needed(world_size, elastic, job.attempts > 0)
    kind = device_type_for(job.requested_device, live, least)
    eligible = [d for d in live if kind is None or d.type == kind]
    idle = sorted(d.id for d in eligible if d.id not in slots)
    held = sorted(d.id for d in eligible if d.id in slots and slots[d.id].state == HELD and slots[d.id].job == job.id)
    promised = sorted(d.id for d in eligible if d.id in slots and slots[d.id].promised == job.id)
    what = "GPU" if kind == "cuda" else "CPU" if kind == "cpu" else ""
    wanted = f"{least} to {world_size}" if least < world_size else f"{world_size}"
    pinned = (f"; rank 0 on {job.requested_device}"
              if kind and job.requested_device not in ("auto", *DEVICE_TYPES) else "")
    note = (f"waiting for {wanted} free {what + ' ' if what else ''}workers at once (world_size {world_size}{pinned}); "
            f"free now: {len(idle)}{' (' + ', '.join(idle) + ')' if idle else ''} of {len(eligible)} live")
    note += f"; holding {', '.join(held)} for it" if held else ""
    return note + (f"; then {', '.join(promised)} once the job running there ends" if promised else "")


# --- holds ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotView:
    """One live device's slot as a pass sees it (`read_slot`): `state` is FREE for an empty slot and
    for a reservation or hold that no longer stands; `promised` is the waiting delivery it is held
    for once its task ends (busy or reserved slots); `stale` marks a hold or promise that no longer
    stands (dropped by the next pass, for tidiness: it already binds nobody)."""

    device: str
    state: str = FREE
    job: str = ""  # reserved or held for, or busy with
    entry: str = ""  # held: the waiting delivery ("<job>.<token>") it is held for
    promised: str = ""
    stale: bool = False


@dataclass(frozen=True)
class Holder:
    """The oldest waiting gang that fits: its waiting delivery, its job, how many devices it needs to
    start, and rank 0's device when the job named one."""

    entry: str
    job: str
    need: int
    pinned: str | None = None


def _stands(deadline: str | None, now: float) -> bool:
    return deadline is not None and now < float(deadline)


def read_slot(device: str, raw: dict[str, str], now: float, waiting: Iterable[str]) -> SlotView:
    """A slot hash (core/devices/slots.py's fields) as it binds at `now` (Redis time), given the deliveries
    that still wait."""
    state = raw.get("state") or FREE
    waits = set(waiting)
    stands = _stands(raw.get("deadline"), now) and (state != HELD or raw.get("entry") in waits)
    stale = state in (RESERVED, HELD) and not stands
    if stale:
        state = FREE
    promised = raw.get("hold_entry", "")
    if promised and not (_stands(raw.get("hold_deadline"), now) and promised in waits):
        promised, stale = "", True
    job = raw.get("job", "") if state != FREE else ""
    entry = raw.get("entry", "") if state == HELD else ""
    return SlotView(device, state, job, entry, promised, stale)


def single_may_start(slot: SlotView) -> bool:
    """Whether a single-device job may start on this device now (see the module docstring). A busy
    slot is the worker's own (it runs one task at a time): a predecessor's, taken over."""
    return slot.state not in (HELD, RESERVED)


def placement_order(candidates: Sequence[P], pinned: str | None) -> list[P]:
    """Candidates packed by host (the host with the most first, then by id), `pinned` first: fewer
    ranks talk across hosts."""
    per_host = Counter(d.id.split("/", 1)[0] for d in candidates)
    ordered = sorted(candidates, key=lambda d: (-per_host[d.id.split("/", 1)[0]], d.id))
    if pinned is not None:
        ordered = [d for d in ordered if d.id == pinned] + [d for d in ordered if d.id != pinned]
    return ordered


def devices_to_hold(holder: Holder, candidates: Sequence[SlotView]) -> list[str]:
    """The devices `holder` holds, from `candidates` (the live devices of its type, in placement
    order): the ones it can have now, up to `need` (rank 0's first when pinned); while those are
    fewer than `need`, also every busy or reserved one, for when its task ends."""
    now_free = [s for s in candidates if s.state in (FREE, HELD)]
    if holder.pinned is not None and not any(s.device == holder.pinned for s in now_free):
        now_free = now_free[:holder.need - 1]  # rank 0's device is busy: it comes with the promises
    chosen = [s.device for s in now_free[:holder.need]]
    if len(chosen) < holder.need:
        chosen += [s.device for s in candidates if s.state in (BUSY, RESERVED)]
    return chosen


def hold_plan(holder: Holder | None, candidates: Sequence[SlotView], live: Sequence[SlotView]) -> dict[str, str]:
    """What a pass does to each live device's slot: HOLD (hold it for `holder`, or promise it once its
    task ends; renews a hold it has) or DROP (a hold or promise nobody should have: another gang's,
    one the holder no longer needs, or a stale one). Devices not named stay as they are."""
    chosen = devices_to_hold(holder, candidates) if holder is not None else []
    plan = dict.fromkeys(chosen, HOLD)
    for slot in live:
        if slot.device not in chosen and (slot.state == HELD or slot.promised or slot.stale):
            plan[slot.device] = DROP
    return plan

