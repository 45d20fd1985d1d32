"""Which devices a waiting data-parallel job holds, and when a held device may still start a
single-device job: the decisions, pure and free of Redis.

The gang scheduler (core/gang_scheduler.py) reads the device slots, asks these functions, and
applies the answer in one Lua script; the slot scripts of core/gangs.py enforce the same rules
atomically when a worker starts or ends a task (`single_may_start` and `read_slot` are their
twins, and tests/core/test_gangs.py checks that both agree).

The rules:

- **Who holds.** Only the oldest waiting gang that fits the live devices of its type (its
  "holder" here), so two waiting gangs never block each other; a gang larger than the live
  devices of its type holds nothing. Every other hold is dropped by the pass that sees it.
- **What it holds.** The devices it can have now (free, or held by anyone: only the holder holds),
  up to the number it needs to start (`need`: its world size, or 1 for an elastic job resuming
  after a fault), rank 0's device first when the job named one, packed by host as the placement
  is. While it has fewer than that, it also holds every busy device of its type *for when its
  task ends*: a promise on the slot, which the worker's own release turns into a hold, so the
  next single-device job in the queue never takes it; the gang starts as soon as enough of them
  are free, whichever end first.
- **When a held device may still start a single-device job** (`single_may_start`): when its hold
  lapsed (no scheduler pass renewed it for `HOLD_S`: every worker's heartbeat is gone) or its gang
  no longer waits (placed, cancelled, or given a new delivery). A device reserved for a gang's
  rank takes nothing until the reservation lapses.
- **The bound.** From the first pass that sees it as the holder (each worker's heartbeat runs one),
  no single-device job starts on a device of its type that is busy then, nor on the free ones it
  holds: it starts at the next pass after the first `need` of them are free, that is after the
  tasks running at that first pass, never after a task that started later. A free device it
  holds idles until then and no longer: held devices beyond what it needs are let go when it is
  placed (core/gang_scheduler.py); a hold nobody renews lapses after `HOLD_S`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

# How long a hold (or a promise) lasts unless a pass renews it: every live worker's heartbeat runs
# a pass, so this only ends holds that nobody renews (the workers are gone).
HOLD_S = 5.0

FREE, HELD, RESERVED, BUSY = "free", "held", "reserved", "busy"
HOLD, DROP = "hold", "drop"


class Placed(Protocol):
    """What the placement needs of a device (core/schemas.Device has it)."""

    @property
    def id(self) -> str: ...


P = TypeVar("P", bound=Placed)


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
    """A slot hash (core/gangs.py's fields) as it binds at `now` (Redis time), given the deliveries
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

