"""The job store against a real Redis: transitions, leases, redelivery, cancellation, listing,
fencing of stale deliveries, the dispatch reconciler, Idempotency-Key binding."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from core import keys
from core.clock import redis_now
from core.config import Settings
from core.errors import Conflict, InvalidInput, NotFound
from core.jobs import JobStore, NotOwner
from core.queue import create_celery, dispatcher, queue_for_device
from core.schemas import EpochMetrics, JobStatus, Progress
from tests.core.kinds.examples import train_params
from tests.faulty_link import FaultyLink
from tests.support import TEST_DB, wait_until


@pytest.fixture
def sent() -> list[tuple[str, str, str]]:
    return []


@pytest.fixture
def client(clean_redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(clean_redis_url, decode_responses=True)


@pytest.fixture
def store(client: redis.Redis, sent: list) -> JobStore:
    return JobStore(client, lambda delivery: sent.append((delivery.job_id, delivery.token, delivery.queue)),
                    lease_ttl_s=0.3, max_attempts=2, dispatch_grace_s=0.2)


def _create(store: JobStore, **kw):
    return store.create(model="cifar_net", dataset="fake", params=train_params(epochs=2), requested_device="auto", **kw)


def _metrics(epoch: int, loss: float = 1.0) -> EpochMetrics:
    return EpochMetrics(epoch=epoch, train_loss=loss, train_accuracy=0.5, val_loss=1.0, val_accuracy=0.5,
                        images_per_second=10.0, seconds=1.0)


def _events(store: JobStore, job_id: str) -> list[str]:
    return [fields["event"] for _, fields in store.redis.xrange(keys.job_events(job_id))]


def test_queue_routing() -> None:
    assert queue_for_device("auto") == "train"
    assert queue_for_device("cuda") == "train.cuda"
    assert queue_for_device("cpu") == "train.cpu"
    assert queue_for_device("host/cuda:1") == "train.dev.host/cuda:1"


def test_lifecycle_and_events(store: JobStore, sent: list) -> None:
    job, created = _create(store)
    assert created and job.status is JobStatus.queued and job.attempts == 0
    (job_id, token, queue), = sent
    assert job_id == job.id and queue == "train"
    assert store.redis.zscore(keys.DISPATCH_DUE, job.id) is not None  # the intent, written with the record

    assert not store.claim(job.id, "stale-token", worker="w", device_id="h/cpu").run
    claim = store.claim(job.id, token, worker="cpu@h", device_id="h/cpu", instance="i1")
    assert claim.run and claim.attempt == 1 and not claim.resume
    assert not store.claim(job.id, token, worker="cpu@h", device_id="h/cpu", instance="i2").run  # never twice
    # The same instance retrying its claim (its first try reached Redis, the reply did not) runs it.
    assert store.claim(job.id, token, worker="cpu@h", device_id="h/cpu", instance="i1").run
    running = store.get(job.id)
    assert running.status is JobStatus.running and running.device == "h/cpu" and running.started_at
    assert store.redis.zscore(keys.DISPATCH_DUE, job.id) is None
    # The lease expires on Redis's clock, a TTL from the claim.
    assert abs(store.redis.zscore(keys.LEASES, job.id) - redis_now(store.redis) - 0.3) < 0.2

    store.record_epoch(job.id, token, _metrics(1), resume="deliveries/t/resume-1.pt")
    store.record_epoch(job.id, token, _metrics(1), resume="deliveries/t/resume-1.pt")  # a retried write
    assert store.raw_field(job.id, "resume") == "deliveries/t/resume-1.pt"
    assert store.finish(job.id, token, JobStatus.succeeded, checkpoint={"url": "u", "sha256": "s", "bytes": 1},
                        promote=["model.pt"])
    assert store.finish(job.id, token, JobStatus.succeeded)  # retried: still this delivery's success
    done = store.get(job.id)
    assert done.status is JobStatus.succeeded and done.finished_at and len(done.metrics) == 1
    assert _events(store, job.id) == ["status", "status", "metrics", "status"]
    (pending,) = store.pending_settlements(redis_now(store.redis) + 60)
    assert pending.job_id == job.id and pending.token == token and pending.promote == ["model.pt"]
    store.settled(job.id)
    assert store.pending_settlements(redis_now(store.redis) + 60) == []


def test_cancel_queued_never_starts(store: JobStore, sent: list) -> None:
    job, _ = _create(store)
    assert store.request_cancel(job.id).status is JobStatus.cancelled
    assert not store.claim(job.id, sent[0][1], worker="w", device_id="d").run
    assert store.redis.zscore(keys.DISPATCH_DUE, job.id) is None
    with pytest.raises(Conflict):
        store.request_cancel(job.id)
    with pytest.raises(NotFound):
        store.request_cancel("doesnotexist")


def test_cancel_running_is_seen_by_the_step_check(store: JobStore, sent: list) -> None:
    job, _ = _create(store)
    token = sent[0][1]
    store.claim(job.id, token, worker="w", device_id="d")
    assert store.stop_reason(job.id, token) is None
    assert store.request_cancel(job.id).status is JobStatus.running
    assert store.stop_reason(job.id, token) == "cancelled"
    assert store.stop_reason(job.id, "another-token") == "lease_lost"
    assert store.finish(job.id, token, JobStatus.cancelled)


def test_expired_lease_is_redelivered_with_a_new_token_then_fails(store: JobStore, sent: list) -> None:
    job, _ = _create(store)
    first_token = sent[0][1]
    store.claim(job.id, first_token, worker="w1", device_id="d1")
    assert store.sweep_expired_leases() == []  # still fresh
    time.sleep(0.4)
    assert store.sweep_expired_leases() == [job.id]
    requeued = store.get(job.id)
    assert requeued.status is JobStatus.queued and requeued.attempts == 1
    second_token = sent[1][1]
    assert second_token != first_token
    assert not store.renew_lease(job.id, first_token)  # the old delivery must stop
    assert store.stop_reason(job.id, first_token) == "lease_lost"
    assert not store.finish(job.id, first_token, JobStatus.succeeded)
    claim = store.claim(job.id, second_token, worker="w2", device_id="d2")
    assert claim.run and claim.attempt == 2 and claim.resume
    time.sleep(0.4)
    assert store.sweep_expired_leases() == [job.id]  # max_attempts=2 reached: failed, not requeued
    failed = store.get(job.id)
    assert failed.status is JobStatus.failed and "gave up after 2 attempts" in failed.error
    assert len(sent) == 2 and store.recovery_stats()["expired_leases"] == 2


def test_renewed_lease_is_not_swept(store: JobStore, sent: list) -> None:
    job, _ = _create(store)
    store.claim(job.id, sent[0][1], worker="w", device_id="d")
    for _ in range(4):
        time.sleep(0.15)
        assert store.renew_lease(job.id, sent[0][1])
        assert store.sweep_expired_leases() == []


def test_an_owner_that_renews_while_the_sweep_reads_keeps_its_job(client: redis.Redis, clean_redis_url: str,
                                                                 sent: list) -> None:
    """The sweep reads the expired leases, then redelivers each in a transaction of its own; an
    owner whose renewal lands between the two keeps its job, because the transaction checks the
    lease again. The interleaving is made, not hoped for: the sweep's connection goes through a
    link that holds the reply to its read until the owner has renewed."""
    store = JobStore(client, lambda delivery: sent.append(delivery.token), lease_ttl_s=30, max_attempts=3)
    job, _ = _create(store)
    owner = sent[0]
    store.claim(job.id, owner, worker="w1", device_id="d1")
    expiry = store.redis.zscore(keys.LEASES, job.id)
    link = FaultyLink(clean_redis_url)
    sweeping_client = redis.Redis.from_url(link.url(TEST_DB + 1), decode_responses=True)
    sweeper = JobStore(sweeping_client, lambda delivery: sent.append(delivery.token), lease_ttl_s=30, max_attempts=3)
    swept: list[list[str]] = []
    try:
        link.hold_replies_after(b"ZRANGEBYSCORE")
        # The sweep's clock says the lease expired (as after a freeze of the owner's host).
        reading = threading.Thread(target=lambda: swept.append(sweeper.sweep_expired_leases(now=expiry)))
        reading.start()
        wait_until(lambda: link.marked >= 1, timeout=10, what="the sweep to read the expired leases")
        wait_until(lambda: redis_now(client) > expiry - 30, timeout=5, what="Redis's clock to move on")
        assert store.renew_lease(job.id, owner)  # the owner's beat, between the read and the transaction
        link.release()
        reading.join(timeout=10)
    finally:
        link.close()
        sweeping_client.close()
    assert swept == [[]], (f"the sweep redelivered {swept} although its owner renewed the lease after the sweep "
                           f"read it: the redelivery transaction must check the lease again")
    kept = store.get(job.id)
    assert kept.status is JobStatus.running and store.raw_field(job.id, "delivery") == owner and kept.attempts == 1
    assert store.stop_reason(job.id, owner) is None and len(sent) == 1


def test_a_stale_delivery_changes_nothing(store: JobStore, sent: list) -> None:
    """After its lease was taken over, every write the old delivery tries is refused, inside the
    script or transaction that would make it, and leaves the record and the stream as they were."""
    job, _ = _create(store)
    stale = sent[0][1]
    store.claim(job.id, stale, worker="w1", device_id="d1")
    store.record_epoch(job.id, stale, _metrics(1), resume=f"deliveries/{stale}/resume-1.pt")
    time.sleep(0.4)
    store.sweep_expired_leases()
    owner = sent[1][1]
    store.claim(job.id, owner, worker="w2", device_id="d2")
    store.set_params(job.id, owner, {"epochs": 2, "batch_size": 64})
    before = (store.redis.hgetall(keys.job(job.id)), store.redis.xrange(keys.job_events(job.id)))

    writes = [
        lambda: store.update_progress(job.id, stale, Progress(epoch=2, epochs=2, step=9, steps=9)),
        lambda: store.set_params(job.id, stale, {"epochs": 2, "batch_size": 1}),
        lambda: store.set_classes(job.id, stale, ["x"]),
        lambda: store.set_resumed(job.id, stale, 1),
        lambda: store.record(job.id, stale, {"message": "stale"}, ("status", {"status": "succeeded"})),
        lambda: store.record_epoch(job.id, stale, _metrics(2), resume=f"deliveries/{stale}/resume-2.pt"),
    ]
    for write in writes:
        with pytest.raises(NotOwner):
            write()
    assert not store.finish(job.id, stale, JobStatus.succeeded, checkpoint={"url": "u", "sha256": "bad", "bytes": 1})
    assert not store.finish(job.id, stale, JobStatus.cancelled)
    assert not store.requeue(job.id, stale, "shutdown")
    assert not store.renew_lease(job.id, stale)
    assert (store.redis.hgetall(keys.job(job.id)), store.redis.xrange(keys.job_events(job.id))) == before

    store.update_progress(job.id, owner, Progress(epoch=2, epochs=2, step=1, steps=9))  # the owner still writes
    assert store.get(job.id).progress.step == 1


def test_requeue_is_fenced_and_bounded(store: JobStore, sent: list) -> None:
    job, _ = _create(store)
    store.claim(job.id, sent[0][1], worker="w", device_id="d")
    assert not store.requeue(job.id, "not-the-token", "shutdown")
    assert store.requeue(job.id, sent[0][1], "worker w shut down")
    requeued = store.get(job.id)
    assert requeued.status is JobStatus.queued and "shut down" in requeued.message
    assert store.redis.zscore(keys.DISPATCH_DUE, job.id) is not None
    store.claim(job.id, sent[1][1], worker="w", device_id="d")
    assert store.requeue(job.id, sent[1][1], "worker w shut down")  # the second attempt was the last
    failed = store.get(job.id)
    assert failed.status is JobStatus.failed and "gave up after 2 attempts: worker w shut down" in failed.error
    assert len(sent) == 2


def test_idempotency_key_is_bound_to_the_request(store: JobStore, sent: list) -> None:
    first, created = _create(store, idempotency_key="abc")
    again, created_again = _create(store, idempotency_key="abc")
    assert created and not created_again and again.id == first.id and len(sent) == 1
    with pytest.raises(InvalidInput, match="different request"):
        store.create(model="cifar_net", dataset="fake", params=train_params(epochs=3), requested_device="auto",
                     idempotency_key="abc")
    # A key left without its job (a first-wave record whose creator died before writing the job)
    # does not block retries: the request creates the job.
    store.redis.set(keys.idempotency("orphan"), "00000000000000deadbeef00")
    job, created = _create(store, idempotency_key="orphan")
    assert created and store.get(job.id).status is JobStatus.queued


def test_a_job_whose_message_was_never_sent_is_sent_by_the_reconciler(client: redis.Redis) -> None:
    attempts: list[str] = []

    def broker_down(delivery) -> None:
        attempts.append(delivery.token)
        raise ConnectionError("the broker went away after the record was written")

    store = JobStore(client, broker_down, lease_ttl_s=0.3, dispatch_grace_s=0.2)
    job, created = _create(store)  # accepted: the record and the intent are there, the send failed
    assert created and store.get(job.id).status is JobStatus.queued and len(attempts) == 1
    assert store.reconcile_dispatch() == []  # not overdue yet
    time.sleep(0.25)
    assert store.reconcile_dispatch() == [job.id] and attempts[1] == attempts[0]  # the same delivery again
    assert store.reconcile_dispatch() == []  # postponed by a grace period, not re-sent every sweep


def test_the_reconciler_resends_only_lost_messages(client: redis.Redis, clean_redis_url: str) -> None:
    """Real Celery messages in the real queue lists: jobs waiting behind a busy worker are left
    alone however often the reconciler runs; a message a worker took and never acknowledged
    (it died) is re-sent once per grace period; the queue never grows beyond one message a job."""
    celery = create_celery(Settings(redis_url=clean_redis_url))
    store = JobStore(client, dispatcher(celery), lease_ttl_s=0.3, dispatch_grace_s=0.2)
    jobs = [_create(store)[0].id for _ in range(5)]
    assert client.llen("train") == 5
    for _ in range(5):
        time.sleep(0.1)
        assert store.reconcile_dispatch() == []
    assert client.llen("train") == 5

    client.rpop("train")  # a worker took the oldest message and died before claiming it
    time.sleep(0.25)
    assert store.reconcile_dispatch() == [jobs[0]]
    for _ in range(6):
        time.sleep(0.1)
        store.reconcile_dispatch()
    assert client.llen("train") == 5 and store.recovery_stats()["resent_deliveries"] == 1
    store.claim(jobs[0], store.raw_field(jobs[0], "delivery"), worker="w", device_id="d")
    assert client.zscore(keys.DISPATCH_DUE, jobs[0]) is None


def test_list_newest_first_with_cursor_and_filter(store: JobStore, sent: list) -> None:
    ids = [_create(store)[0].id for _ in range(5)]
    store.request_cancel(ids[1])
    page = store.page(limit=2)
    assert [j.id for j in page.jobs] == ids[::-1][:2] and page.next_cursor == ids[3]
    rest = store.page(limit=10, cursor=page.next_cursor)
    assert [j.id for j in rest.jobs] == ids[::-1][2:] and rest.next_cursor is None
    assert [j.id for j in store.page(status=JobStatus.cancelled).jobs] == [ids[1]]
    assert len(store.page(status=JobStatus.queued).jobs) == 4
