"""The sweep's guards against mass redelivery (worker/runtime/heartbeat.py), on a clock the test
drives: after an outage, a stall or a gap a worker sweeps only once it has seen Redis answer beat
after beat for a whole lease TTL, and never with a Redis TIME whose round trip took too long.

Redis is real (an embedded redis-server stopped and started again, a TCP link that holds a reply);
only the heartbeat's monotonic clock is the test's, so "five seconds of healthy beats" is five
`advance(1)` calls, not a race against the host's load. Each test starts from a running job whose
lease lapsed on Redis's clock (as every lease does during an outage) and asks, beat by beat,
whether the sweep has redelivered it yet."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.embedded_redis import EmbeddedRedis
from core import keys
from core.clock import redis_now
from core.devices import DeviceRegistry
from core.jobs import JobStore
from core.schemas import JobStatus
from core.storage import CheckpointPaths
from tests.core.kinds.examples import train_params
from tests.faulty_link import FaultyLink
from tests.support import TEST_DB, wait_until
from worker.device.pinning import WorkerDevice
from worker.runtime.heartbeat import MAX_CLOCK_ROUND_TRIP_S, Heartbeat, Sweeper
from worker.runtime.state import WorkerState

LEASE_TTL_S = 5.0  # what the sweeper waits for, on the driven clock
INTERVAL_S = 1.0  # a beat a second: a stall is a beat over max(interval, 1 s), a gap one over 2 s


class DrivenClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _lapsed_job(store: JobStore) -> str:
    """A job running under another worker's delivery whose lease has expired on Redis's clock."""
    job, _ = store.create(model="cifar_net", dataset="fake", params=train_params(epochs=1), requested_device="auto")
    token = store.raw_field(job.id, "delivery")
    assert store.claim(job.id, token, worker="cpu@elsewhere", device_id="elsewhere/cpu", instance="other").run
    expiry = store.redis.zscore(keys.LEASES, job.id)
    wait_until(lambda: redis_now(store.redis) > expiry, timeout=5, what="the lease to lapse on Redis's clock")
    return job.id


def _status(store: JobStore, job_id: str) -> JobStatus:
    return store.get(job_id).status


def _store(client: redis.Redis) -> JobStore:
    return JobStore(client, lambda delivery: None, lease_ttl_s=0.05, max_attempts=5, dispatch_grace_s=60)


def _heartbeat(store: JobStore, tmp_path: Path, clock: DrivenClock,
               during_beat: list[float] | None = None) -> Heartbeat:
    """A CPU worker's heartbeat with a sweeper, both on `clock`. Each number put in `during_beat`
    is how long the next beat takes (the clock moves while it publishes: a slow Redis)."""
    during_beat = during_beat if during_beat is not None else []

    def loaded_models() -> list[str]:  # read by every beat, between its start and its end
        if during_beat:
            clock.advance(during_beat.pop(0))
        return []

    sweeper = Sweeper(store, CheckpointPaths(tmp_path / "checkpoints"), "instance-a", LEASE_TTL_S,
                      every_s=0.001, monotonic=clock)
    return Heartbeat(WorkerDevice("cpu", None, "sweeptest"), "instance-a", DeviceRegistry(store.redis, 6.0), store,
                     WorkerState(), loaded_models, INTERVAL_S, sweeper=sweeper, monotonic=clock)


def _beats_until_swept(heartbeat: Heartbeat, store: JobStore, job_id: str, clock: DrivenClock,
                       most: int = 10) -> int:
    """Beat once a second (on the driven clock) until the sweep redelivers `job_id`; the number of
    seconds of healthy beats that took (the first beat counts as 0)."""
    for second in range(most):
        heartbeat.tick()
        if _status(store, job_id) is JobStatus.queued:
            return second
        clock.advance(INTERVAL_S)
    raise AssertionError(f"the sweep never redelivered the lapsed job in {most} s of healthy beats")


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_after_an_outage_a_worker_sweeps_only_once_redis_answered_for_a_lease_ttl(
        own_redis: EmbeddedRedis, tmp_path: Path) -> None:
    client = redis.Redis.from_url(own_redis.url, decode_responses=True)
    store = _store(client)
    clock = DrivenClock()
    heartbeat = _heartbeat(store, tmp_path, clock)
    for _ in range(int(LEASE_TTL_S) + 2):  # a worker long healthy, sweeping (nothing to redeliver yet)
        heartbeat.tick()
        clock.advance(INTERVAL_S)
    job_id = _lapsed_job(store)  # another worker's job, whose lease lapses during the outage
    own_redis.stop()  # the outage, one beat long: the beat fails, and the heartbeat goes on
    heartbeat.tick()
    clock.advance(INTERVAL_S)
    own_redis.start()  # back, with the job and its lapsed lease (append-only file)
    assert _status(store, job_id) is JobStatus.running
    swept_after = _beats_until_swept(heartbeat, store, job_id, clock)
    assert swept_after >= LEASE_TTL_S, (
        f"the sweep redelivered a running job {swept_after} s after Redis answered again; it must wait a whole "
        f"lease TTL ({LEASE_TTL_S} s) of healthy beats, or every job whose lease lapsed during the outage is "
        f"redelivered while its live worker has had no chance to renew")
    assert swept_after == LEASE_TTL_S, f"swept {swept_after} s after the outage: later than one lease TTL"
    client.close()


def test_a_gap_between_beats_or_a_stalled_beat_starts_the_count_again(clean_redis_url: str, tmp_path: Path) -> None:
    """A beat more than interval + stall after the last one (the process was frozen, or Redis
    was), or a beat that itself took longer than the stall (Redis answered slowly), is no proof
    that Redis answered throughout: the lease TTL is counted again from there."""
    client = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    store = _store(client)
    for name, upset in (("a 3 s gap between two beats", "gap"), ("a beat that took 1.5 s", "stall")):
        clock = DrivenClock()
        slow_beats: list[float] = []
        heartbeat = _heartbeat(store, tmp_path, clock, slow_beats)
        job_id = _lapsed_job(store)
        for _ in range(3):  # three healthy seconds
            heartbeat.tick()
            clock.advance(INTERVAL_S)
        if upset == "gap":
            clock.advance(3.0)
        else:
            slow_beats.append(1.5)
        swept_after = _beats_until_swept(heartbeat, store, job_id, clock)
        assert swept_after >= LEASE_TTL_S, (
            f"after {name} the sweep redelivered a running job {swept_after} s later; the count of healthy "
            f"beats must start again there (a lease TTL, {LEASE_TTL_S} s)")
        client.delete(keys.SWEEP_LOCK)
    client.close()


def test_the_sweep_never_uses_a_redis_time_that_took_long_to_come_back(clean_redis_url: str) -> None:
    """Redis TIME read after a freeze is later than the renewals still queued behind it: a lease
    renewed during the freeze would look expired. A TIME whose reply took longer than
    MAX_CLOCK_ROUND_TRIP_S is not used; the next sweep, with a prompt one, is."""
    direct = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    job_id = _lapsed_job(_store(direct))
    link = FaultyLink(clean_redis_url)
    via_link = redis.Redis.from_url(link.url(TEST_DB + 1), decode_responses=True)  # clean_redis_url's database
    store = _store(via_link)
    clock = DrivenClock()
    sweeper = Sweeper(store, CheckpointPaths(Path("/nonexistent")), "instance-a", LEASE_TTL_S,
                      every_s=0.001, monotonic=clock)
    try:
        link.hold_replies_after(b"TIME")
        sweeping = threading.Thread(target=sweeper.maybe_sweep, args=(60.0,))
        sweeping.start()
        wait_until(lambda: link.marked >= 1, timeout=10, what="the sweep to ask Redis the time")
        clock.advance(MAX_CLOCK_ROUND_TRIP_S + 0.5)  # while its reply is held back
        link.release()
        sweeping.join(timeout=10)
        assert _status(store, job_id) is JobStatus.running, (
            f"the sweep redelivered a job using a Redis TIME whose reply took {MAX_CLOCK_ROUND_TRIP_S + 0.5} s "
            f"(over MAX_CLOCK_ROUND_TRIP_S = {MAX_CLOCK_ROUND_TRIP_S} s): a clock read that waited out a freeze")
        direct.delete(keys.SWEEP_LOCK)
        clock.advance(1.0)
        sweeper.maybe_sweep(60.0)  # TIME answered at once
        assert _status(store, job_id) is JobStatus.queued, "a prompt TIME did not let the sweep redeliver the job"
    finally:
        link.close()
        via_link.close()
        direct.close()
