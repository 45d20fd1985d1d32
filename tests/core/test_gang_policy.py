"""The gang-hold decisions of core/gang_policy.py, on their own (no Redis): which devices the oldest
waiting gang holds, what every other hold becomes, and when a device may start a single-device job.
tests/core/test_gangs.py checks the Lua scripts decide the same, and what a pass does with them."""

from __future__ import annotations

from dataclasses import dataclass

from core.gang_policy import (
    BUSY,
    DROP,
    FREE,
    HELD,
    HOLD,
    RESERVED,
    Holder,
    SlotView,
    devices_to_hold,
    hold_plan,
    placement_order,
    read_slot,
    single_may_start,
)

NOW = 1000.0
GANG = Holder(entry="g.t", job="g", need=2)


@dataclass(frozen=True)
class Dev:
    id: str


def test_a_slot_binds_while_its_deadline_stands_and_its_gang_waits() -> None:
    later, earlier = str(NOW + 5), str(NOW - 5)
    held = {"state": "held", "job": "g", "entry": "g.t", "deadline": later}
    assert read_slot("a", held, NOW, {"g.t"}) == SlotView("a", HELD, "g", "g.t")
    assert read_slot("a", held, NOW, set()) == SlotView("a", FREE, stale=True)  # its gang no longer waits
    assert read_slot("a", held | {"deadline": earlier}, NOW, {"g.t"}) == SlotView("a", FREE, stale=True)
    reserved = {"state": "reserved", "job": "g", "deadline": later}
    assert read_slot("a", reserved, NOW, set()).state == RESERVED  # a reservation waits for its ranks
    assert read_slot("a", reserved | {"deadline": earlier}, NOW, set()).state == FREE
    busy = {"state": "busy", "job": "x", "hold_job": "g", "hold_entry": "g.t", "hold_deadline": later}
    assert read_slot("a", busy, NOW, {"g.t"}) == SlotView("a", BUSY, "x", promised="g.t")
    assert read_slot("a", busy, NOW, set()) == SlotView("a", BUSY, "x", stale=True)
    assert read_slot("a", {}, NOW, set()) == SlotView("a")


def test_a_single_job_starts_only_where_no_gang_holds_or_has_reserved() -> None:
    assert single_may_start(SlotView("a"))
    assert single_may_start(SlotView("a", BUSY, "x", promised="g.t"))  # the worker's own, taken over
    assert not single_may_start(SlotView("a", HELD, "g", "g.t"))
    assert not single_may_start(SlotView("a", RESERVED, "g"))
    lapsed = read_slot("a", {"state": "held", "job": "g", "entry": "g.t", "deadline": str(NOW - 1)}, NOW, {"g.t"})
    assert single_may_start(lapsed)


def test_a_gang_holds_what_is_free_and_every_busy_device_while_that_is_too_few() -> None:
    slots = [SlotView("a", BUSY, "x"), SlotView("b"), SlotView("c", BUSY, "y"), SlotView("d", RESERVED, "h")]
    # One free: it is held, and every busy or reserved one for when its task ends; the gang starts
    # once the first of them ends, whichever it is.
    assert devices_to_hold(GANG, slots) == ["b", "a", "c", "d"]
    # Enough free ones (held by anyone counts: only the holder holds): those, and no busy device.
    slots = [SlotView("a", BUSY, "x"), SlotView("b"), SlotView("c", HELD, "other", "o.t"), SlotView("d")]
    assert devices_to_hold(GANG, slots) == ["b", "c"]


def test_rank_zeros_device_comes_first_and_when_busy_is_waited_for() -> None:
    pinned = Holder(entry="g.t", job="g", need=2, pinned="a")
    slots = [SlotView("a", BUSY, "x"), SlotView("b"), SlotView("c"), SlotView("d", BUSY, "y")]
    # Without rank 0's device nothing starts: one other free device is held with it, not two.
    assert devices_to_hold(pinned, slots) == ["b", "a", "d"]
    slots = [SlotView("a"), SlotView("b", BUSY, "x"), SlotView("c", BUSY, "y")]
    assert devices_to_hold(pinned, slots) == ["a", "b", "c"]


def test_every_other_hold_is_dropped_and_nobody_holds_when_no_gang_fits() -> None:
    live = [SlotView("a", HELD, "other", "o.t"), SlotView("b", BUSY, "x", promised="o.t"), SlotView("c"),
            SlotView("d", FREE, stale=True), SlotView("e", BUSY, "y")]
    cpu = live[:3]
    assert hold_plan(GANG, cpu, live) == {"a": HOLD, "c": HOLD, "b": DROP, "d": DROP}
    assert hold_plan(None, [], live) == {"a": DROP, "b": DROP, "d": DROP}
    assert hold_plan(None, [], [SlotView("a"), SlotView("b", BUSY, "x")]) == {}


def test_the_holder_lets_go_of_a_busy_device_once_enough_are_free() -> None:
    """A busy device promised while it had too few is let go when enough are free: it is not held
    idle after its task for a gang that already has its devices."""
    live = [SlotView("a", HELD, "g", "g.t"), SlotView("b", BUSY, "x", promised="g.t"), SlotView("c")]
    assert hold_plan(GANG, live, live) == {"a": HOLD, "c": HOLD, "b": DROP}


def test_placement_packs_ranks_by_host_and_puts_rank_zeros_device_first() -> None:
    devices = [Dev("h2/cpu"), Dev("h1/gpu1"), Dev("h3/cpu"), Dev("h1/gpu0")]
    assert [d.id for d in placement_order(devices, None)] == ["h1/gpu0", "h1/gpu1", "h2/cpu", "h3/cpu"]
    assert [d.id for d in placement_order(devices, "h3/cpu")] == ["h3/cpu", "h1/gpu0", "h1/gpu1", "h2/cpu"]
