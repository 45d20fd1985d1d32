"""The gang policy (core/gangs/policy.py), on its own (no Redis): how many devices a gang needs and of
which type, the submit check, what a waiting gang's message says, the timings read from Settings,
which devices the oldest waiting gang holds, what every other hold becomes, and when a device may
start a single-device job. tests/core/devices/test_slots.py checks the Lua scripts decide the same,
and tests/core/gangs/test_scheduler.py what a pass does with them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from core.config import Settings
from core.devices import SlotState
from core.errors import InvalidInput
from core.gangs import GangState, Member
from core.gangs.policy import (
    BUSY,
    DROP,
    FREE,
    HELD,
    HOLD,
    RESERVED,
    Holder,
    SlotView,
    check_world_size,
    collective_timeout_s,
    device_type_for,
    devices_needed,
    devices_to_hold,
    hold_plan,
    placement_order,
    read_slot,
    reservation_s,
    single_may_start,
    waiting_note,
)
from core.schemas import Device, Job, JobStatus

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


def _device(device_id: str, kind: str = "cpu", status: str = "idle") -> Device:
    return Device(id=device_id, type=kind, index=None, name=kind, memory_total_bytes=None, memory_used_bytes=None,
                  utilization_percent=None, worker=f"{kind}@{device_id.split('/')[0]}", status=status,
                  current_job=None, loaded_models=[], last_heartbeat="2026-01-01T00:00:00+00:00")


def _job(requested: str = "auto", attempts: int = 0) -> Job:
    return Job(id="g", status=JobStatus.queued, model="cifar_net", dataset="fake", params={}, requested_device=requested,
               attempts=attempts, created_at=datetime(2026, 1, 1, tzinfo=UTC))


def test_a_gang_needs_all_its_devices_unless_an_elastic_one_resumes() -> None:
    assert devices_needed(4, elastic=False, delivered_before=False) == 4
    assert devices_needed(4, elastic=False, delivered_before=True) == 4
    assert devices_needed(4, elastic=True, delivered_before=False) == 4  # the first attempt: all of them
    assert devices_needed(4, elastic=True, delivered_before=True) == 1  # after a fault: as many as are free


def test_an_auto_gang_takes_gpus_when_enough_are_there_else_cpus_never_a_mix() -> None:
    two_gpus_three_cpus = [_device("h1/gpu0", "cuda"), _device("h1/gpu1", "cuda"),
                           *(_device(f"h{n}/cpu") for n in (1, 2, 3))]
    assert device_type_for("auto", two_gpus_three_cpus, 2) == "cuda"
    assert device_type_for("auto", two_gpus_three_cpus, 3) == "cpu"
    assert device_type_for("auto", two_gpus_three_cpus, 4) is None
    assert device_type_for("cuda", two_gpus_three_cpus, 3) == "cuda"  # as asked, enough or not
    assert device_type_for("h1/gpu1", two_gpus_three_cpus, 2) == "cuda"  # rank 0's device's type
    assert device_type_for("h9/cpu", two_gpus_three_cpus, 2) is None  # rank 0's device is not there


def test_submit_refuses_a_gang_larger_than_the_devices_of_its_type() -> None:
    offline = [_device(f"{n}/cpu", status="offline") for n in ("h1", "h2")]  # they may come back: they count
    check_world_size(1, "cuda", [])
    check_world_size(2, "cpu", offline)
    check_world_size(2, "auto", offline)
    check_world_size(2, "h1/cpu", offline)
    with pytest.raises(InvalidInput, match=r"needs 3 CPU devices, one worker each; 2 exist \(h1/cpu, h2/cpu\)"):
        check_world_size(3, "auto", offline)
    with pytest.raises(InvalidInput, match="needs 2 GPU devices, one worker each; 0 exist"):
        check_world_size(2, "cuda", offline)
    with pytest.raises(InvalidInput, match="Ask for at most 2"):
        check_world_size(3, "h1/cpu", offline)


def test_a_waiting_gang_says_what_it_waits_for_and_what_it_holds() -> None:
    live = [_device("a/cpu"), _device("b/cpu"), _device("c/cpu")]
    slots = {"a/cpu": SlotState("held", "g"), "b/cpu": SlotState("busy", "x", promised="g")}
    note = waiting_note(_job(), 3, False, None, live, slots)
    assert note == ("waiting for 3 free CPU workers at once (world_size 3); free now: 1 (c/cpu) of 3 live; "
                    "holding a/cpu for it; then b/cpu once the job running there ends")
    # An elastic job delivered before resumes on fewer; rank 0's device named, on any of its type.
    resumed = waiting_note(_job("b/cpu", attempts=1), 3, True, None, live, slots)
    assert resumed.startswith("waiting for 1 to 3 free CPU workers at once (world_size 3; rank 0 on b/cpu)")
    # Too few live devices of any type: all of them listed, no type named.
    assert waiting_note(_job(), 4, False, None, live, {}).startswith(
        "waiting for 4 free workers at once (world_size 4); free now: 3 (a/cpu, b/cpu, c/cpu) of 3 live")
    # An auto gang counts only the type the scheduler will place it on: one GPU is too few for two
    # ranks, so two CPUs it is (the note used to count the GPU among the free devices it waited for).
    mixed = [_device("h1/cuda:0", "cuda"), _device("h1/cpu"), _device("h2/cpu")]
    assert waiting_note(_job(), 2, False, None, mixed, {}) == (
        "waiting for 2 free CPU workers at once (world_size 2); free now: 2 (h1/cpu, h2/cpu) of 2 live")
    reserved = GangState(attempt="1", token="t", members=[Member(0, "a/cpu", "w"), Member(1, "c/cpu", "w")],
                         running=False, address=None)
    assert waiting_note(_job(), 2, False, reserved, live, slots) == "starting: a/cpu (rank 0), c/cpu (rank 1) reserved for it"


def test_the_timings_an_operator_tunes_are_read_from_settings() -> None:
    assert reservation_s(Settings(lease_ttl_s=7)) == 7
    assert collective_timeout_s(Settings(lease_ttl_s=7)) == 7
    assert collective_timeout_s(Settings(lease_ttl_s=7, gang_timeout_s=90)) == 90
