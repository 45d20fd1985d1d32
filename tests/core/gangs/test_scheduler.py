"""The gang scheduler (core/gangs/scheduler.py) against a real Redis and the real dispatcher (Celery
messages in kombu's lists): a data-parallel job's ranks are reserved all at once or not at all, two
gangs never split the devices between them, a reserved device refuses single-device jobs, a
reservation that lapses frees its devices and its late messages run nothing, an elastic job resumes
on what is free; the oldest waiting gang holds free devices and the busy ones for when their job
ends, and lets go of what it does not use. tests/core/devices/test_slots.py checks the slot scripts
decide as core/gangs/policy.py does."""

from __future__ import annotations

import json
import time

import pytest
import redis

from core import keys
from core.config import Settings
from core.devices import DeviceRegistry, DeviceSlots
from core.gangs import GangRecords, GangScheduler, Seat
from core.jobs import JobStore
from core.queue import create_celery, dispatcher, queue_for_device, waiting_task_ids
from core.schemas import Device, JobStatus
from tests.core.kinds.examples import train_params


@pytest.fixture
def client(clean_redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(clean_redis_url, decode_responses=True)


@pytest.fixture
def cluster(client: redis.Redis, clean_redis_url: str) -> dict:
    dispatch = dispatcher(create_celery(Settings(redis_url=clean_redis_url)), client)
    store = JobStore(client, dispatch, lease_ttl_s=30, dispatch_grace_s=30)
    registry = DeviceRegistry(client, ttl_s=30)
    scheduler = GangScheduler(client, dispatch, registry.all, reservation_s=0.5)
    return {"store": store, "registry": registry, "scheduler": scheduler, "client": client}


def _device(registry: DeviceRegistry, device_id: str, kind: str = "cpu") -> None:
    node = device_id.split("/")[0]
    registry.acquire(device_id, f"instance-{device_id}")
    registry.publish(device_id, f"instance-{device_id}", Device(
        id=device_id, type=kind, index=None, name=kind, memory_total_bytes=None, memory_used_bytes=None,
        utilization_percent=None, worker=f"{kind}@{node}", status="idle", current_job=None, loaded_models=[],
        last_heartbeat="2026-01-01T00:00:00+00:00"))


def _gang_job(store: JobStore, world_size: int = 2, elastic: bool = False, device: str = "cpu") -> tuple[str, str]:
    params = train_params(batch_size=48, world_size=world_size, elastic=elastic)
    job, _ = store.create(model="cifar_net", dataset="fake", params=params, requested_device=device)
    return job.id, store.raw_field(job.id, "delivery") or ""


def _rank_messages(client: redis.Redis, device_id: str) -> list[list]:
    return [json.loads(raw)["headers"]["argsrepr"] for raw in client.lrange(queue_for_device(device_id), 0, -1)]


def _slot_states(client: redis.Redis, devices: list[str]) -> dict[str, str | None]:
    return {d: client.hget(keys.device_slot(d), "state") for d in devices}


def test_gang_jobs_wait_in_their_own_set_and_are_reserved_whole_or_not_at_all(cluster: dict) -> None:
    store, client, scheduler = cluster["store"], cluster["client"], cluster["scheduler"]
    devices = ["a/cpu", "b/cpu", "c/cpu"]
    for device in devices:
        _device(cluster["registry"], device)
    first, first_token = _gang_job(store)
    second, second_token = _gang_job(store)
    # Not a Celery message: the waiting set, which the dispatch reconciler counts as "in its queue".
    assert store.get(first).model_dump()["world_size"] == 2
    assert client.llen("gang.cpu") == 0
    assert waiting_task_ids(client, ["gang.cpu"]) == {f"{first}.{first_token}", f"{second}.{second_token}"}

    assert scheduler.run_once() == [first]  # the older one; then one device is left for a gang of two
    gang = GangRecords(client).read(first)
    assert gang is not None and gang.token == first_token and not gang.running
    assert [(m.rank, m.device) for m in gang.members] == [(0, "a/cpu"), (1, "b/cpu")]
    # Nothing reserved for the second (all or nothing): the free device is only held for it.
    assert _slot_states(client, devices) == {"a/cpu": "reserved", "b/cpu": "reserved", "c/cpu": "held"}
    assert waiting_task_ids(client, ["gang.cpu"]) == {f"{second}.{second_token}"}
    assert GangRecords(client).read(second) is None
    # One message per rank on its device's own queue, naming its seat.
    for rank, device in enumerate(["a/cpu", "b/cpu"]):
        (message,) = _rank_messages(client, device)
        assert first in message and Seat(rank, gang.attempt).encode() in message
    assert _rank_messages(client, "c/cpu") == []

    # The ranks join; nobody else can take their seats or their devices.
    slots = {d: DeviceSlots(client, d) for d in devices}
    assert not slots["a/cpu"].join(first, first_token, Seat(1, gang.attempt))  # the wrong rank
    assert slots["a/cpu"].join(first, first_token, Seat(0, gang.attempt))
    assert slots["b/cpu"].join(first, first_token, Seat(1, gang.attempt))
    assert not slots["a/cpu"].join(first, first_token, Seat(0, gang.attempt))  # once
    # The gang runs and ends: its devices are free again, and the second gang gets two of them.
    assert scheduler.run_once() == []
    for device in ("a/cpu", "b/cpu"):
        slots[device].release(first, first_token, gang.attempt)
    assert scheduler.run_once() == [second]
    assert [m.device for m in GangRecords(client).read(second).members] == ["a/cpu", "b/cpu"]  # type: ignore[union-attr]


def test_two_gangs_never_split_the_devices_between_them(cluster: dict) -> None:
    """Two gangs of two and two devices: one holds both, the other holds none (no deadlock), however
    often the scheduler runs; the waiting one starts when the devices come back."""
    store, client, scheduler = cluster["store"], cluster["client"], cluster["scheduler"]
    for device in ("a/cpu", "b/cpu"):
        _device(cluster["registry"], device)
    jobs = [_gang_job(store) for _ in range(2)]
    placed = [job for _ in range(5) for job in scheduler.run_once() if not time.sleep(0.05)]
    assert placed == [jobs[0][0]]
    states = {d: client.hgetall(keys.device_slot(d)) for d in ("a/cpu", "b/cpu")}
    assert {s["job"] for s in states.values()} == {jobs[0][0]}
    time.sleep(0.6)  # the reservation lapses: nobody claimed it
    assert scheduler.run_once() == [jobs[0][0]]  # undone, and the oldest job placed again, whole
    assert GangRecords(client).read(jobs[1][0]) is None


def test_a_reserved_device_refuses_single_jobs_and_a_lapsed_reservation_runs_nothing(cluster: dict) -> None:
    store, client, scheduler = cluster["store"], cluster["client"], cluster["scheduler"]
    for device in ("a/cpu", "b/cpu"):
        _device(cluster["registry"], device)
    job_id, token = _gang_job(store)
    assert scheduler.run_once() == [job_id]
    attempt = GangRecords(client).read(job_id).attempt  # type: ignore[union-attr]

    # A single-device job's message reaches a reserved worker: refused, and sent back to its queue.
    single, _ = store.create(model="cifar_net", dataset="fake", params=train_params(epochs=1), requested_device="auto")
    single_token = store.raw_field(single.id, "delivery") or ""
    client.delete("train")  # the worker took its message
    a = DeviceSlots(client, "a/cpu")
    assert not a.take_for_job(single.id, single_token)
    scheduler.resend(single.id, single_token)
    assert waiting_task_ids(client, ["train"]) == {f"{single.id}.{single_token}"}

    # Rank 1 joined, rank 0's worker never took its message: the reservation lapses on Redis's clock.
    b = DeviceSlots(client, "b/cpu")
    assert b.join(job_id, token, Seat(1, attempt))
    time.sleep(0.6)
    assert a.take_for_job(single.id, single_token)  # a lapsed reservation holds nothing
    a.release(single.id, single_token)
    scheduler.run_once()
    gang = GangRecords(client).read(job_id)
    assert gang is None or gang.attempt != attempt  # undone (and maybe reserved again, afresh)
    assert not a.join(job_id, token, Seat(0, attempt))  # the late message of the lapsed attempt: nothing
    assert b.state()["state"] == "busy"  # the joined rank frees its own slot when it sees the attempt gone
    b.release(job_id, token, attempt)
    assert store.get(job_id).status is JobStatus.queued


def test_a_device_busy_when_a_gang_waits_is_held_for_it_once_its_job_ends(cluster: dict) -> None:
    """The oldest waiting gang holds the free device at once and the busy one for when its job ends:
    that job's release holds it, so the next single-device job in the queue does not take it (before,
    the release freed it and the next single job took it at once: a backlog starved the gang)."""
    store, client, scheduler = cluster["store"], cluster["client"], cluster["scheduler"]
    for device in ("a/cpu", "b/cpu"):
        _device(cluster["registry"], device)
    a, b = DeviceSlots(client, "a/cpu"), DeviceSlots(client, "b/cpu")
    assert a.take_for_job("single-1", "t")
    oldest, _ = _gang_job(store)
    younger, _ = _gang_job(store)
    too_big, _ = _gang_job(store, world_size=3)  # more than the live devices: it holds nothing
    assert scheduler.run_once() == []
    assert client.hgetall(keys.device_slot("b/cpu")) | {"deadline": "", "entry": ""} == {
        "state": "held", "job": oldest, "deadline": "", "entry": ""}
    assert not b.take_for_job("single-2", "t")  # given back to its queue: the gang's device
    a.release("single-1", "t")
    assert a.state()["state"] == "held"
    assert not a.take_for_job("single-3", "t")  # the next single job in the queue does not take it
    assert scheduler.run_once() == [oldest]
    assert {m.device for m in GangRecords(client).read(oldest).members} == {"a/cpu", "b/cpu"}  # type: ignore[union-attr]
    assert GangRecords(client).read(younger) is None and GangRecords(client).read(too_big) is None


def test_a_gang_lets_go_of_what_it_no_longer_needs(cluster: dict) -> None:
    """Placed, a gang lets go at once of the devices it held and does not use; cancelled, its holds
    bind nobody from the next pass on; a gang that no longer holds has its holds dropped."""
    store, client, scheduler = cluster["store"], cluster["client"], cluster["scheduler"]
    for device in ("a/cpu", "b/cpu", "c/cpu"):
        _device(cluster["registry"], device)
    a, b, c = (DeviceSlots(client, d) for d in ("a/cpu", "b/cpu", "c/cpu"))
    assert a.take_for_job("single-a", "t") and b.take_for_job("single-b", "t")
    gang, _ = _gang_job(store)
    assert scheduler.run_once() == []
    assert c.state()["state"] == "held"
    a.release("single-a", "t")
    assert a.state()["state"] == "held"  # with c, enough
    assert scheduler.run_once() == [gang]
    b.release("single-b", "t")  # b was held for it too, for when its job ended: let go at once
    assert b.take_for_job("single-b2", "t")  # so its release frees it for the next single job

    waiting, _ = _gang_job(store, world_size=3)
    assert scheduler.run_once() == []  # a and c reserved for `gang`, b busy: all three promised to it
    record = GangRecords(client).read(gang)
    assert record is not None
    for slot in (a, c):
        slot.release(gang, record.token, record.attempt)  # the ranks end: held for `waiting`
        assert slot.state()["state"] == "held"
    assert scheduler.run_once() == []  # b is still busy
    store.request_cancel(waiting)
    scheduler.run_once()  # it no longer waits: what it held is let go
    for slot in (a, c):
        assert slot.take_for_job("after-cancel", "t"), slot.state()
    b.release("single-b2", "t")
    assert b.state() == {}


def test_an_elastic_job_resumes_on_what_is_free_and_rank_zero_goes_where_it_was_asked(cluster: dict) -> None:
    store, client, scheduler = cluster["store"], cluster["client"], cluster["scheduler"]
    for device in ("a/cpu", "b/cpu", "c/cpu"):
        _device(cluster["registry"], device)
    busy = DeviceSlots(client, "a/cpu")
    assert busy.take_for_job("other", "t")
    DeviceSlots(client, "b/cpu").take_for_job("other2", "t")
    # First delivery: all three ranks or nothing, even when elastic.
    job_id, _ = _gang_job(store, world_size=3, elastic=True)
    assert scheduler.run_once() == []
    # Delivered once already (a fault ended that attempt): resumes on the one free device.
    client.hset(keys.job(job_id), "attempts", 1)
    assert scheduler.run_once() == [job_id]
    assert [m.device for m in GangRecords(client).read(job_id).members] == ["c/cpu"]  # type: ignore[union-attr]

    # Rank 0 on the device the job named, the other ranks anywhere of its type.
    busy.release("other", "t")
    pinned, _ = _gang_job(store, world_size=2, device="b/cpu")
    assert scheduler.run_once() == []  # b is busy: rank 0's device must be free
    DeviceSlots(client, "b/cpu").release("other2", "t")
    assert scheduler.run_once() == [pinned]
    assert [m.device for m in GangRecords(client).read(pinned).members] == ["b/cpu", "a/cpu"]  # type: ignore[union-attr]
