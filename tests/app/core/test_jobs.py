"""The job store against a real Redis: transitions, leases, redelivery, cancellation, listing."""

from __future__ import annotations

import time

import pytest
import redis

from app.core.errors import Conflict, NotFound
from app.core.jobs import JobStore, queue_for_device
from app.core.schemas import EpochMetrics, JobStatus


@pytest.fixture
def sent() -> list[tuple[str, str, str]]:
    return []


@pytest.fixture
def store(clean_redis_url: str, sent: list) -> JobStore:
    client = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    return JobStore(client, lambda *message: sent.append(message), lease_ttl_s=0.3, max_attempts=2)


def _create(store: JobStore, **kw):
    return store.create(model="cifar_net", dataset="fake", params={"epochs": 2}, requested_device="auto", **kw)


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

    assert not store.claim(job.id, "stale-token", worker="w", device_id="h/cpu").run
    claim = store.claim(job.id, token, worker="cpu@h", device_id="h/cpu")
    assert claim.run and claim.attempt == 1 and not claim.resume
    assert not store.claim(job.id, token, worker="cpu@h", device_id="h/cpu").run  # never twice
    running = store.get(job.id)
    assert running.status is JobStatus.running and running.device == "h/cpu" and running.started_at

    store.record_epoch(job.id, EpochMetrics(epoch=1, train_loss=1.0, train_accuracy=0.5, val_loss=1.0,
                                            val_accuracy=0.5, images_per_second=10.0, seconds=1.0))
    assert store.finish(job.id, token, JobStatus.succeeded, checkpoint={"url": "u", "sha256": "s", "bytes": 1})
    done = store.get(job.id)
    assert done.status is JobStatus.succeeded and done.finished_at and len(done.metrics) == 1
    events = [fields["event"] for _, fields in store.redis.xrange(f"ty:job:{job.id}:events")]
    assert events == ["status", "status", "metrics", "status"]


def test_cancel_queued_never_starts(store: JobStore, sent: list) -> None:
    job, _ = _create(store)
    assert store.request_cancel(job.id).status is JobStatus.cancelled
    assert not store.claim(job.id, sent[0][1], worker="w", device_id="d").run
    with pytest.raises(Conflict):
        store.request_cancel(job.id)
    with pytest.raises(NotFound):
        store.request_cancel("doesnotexist")


def test_cancel_running_sets_the_flag(store: JobStore, sent: list) -> None:
    job, _ = _create(store)
    store.claim(job.id, sent[0][1], worker="w", device_id="d")
    assert not store.cancel_requested(job.id)
    assert store.request_cancel(job.id).status is JobStatus.running
    assert store.cancel_requested(job.id)


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
    assert not store.finish(job.id, first_token, JobStatus.succeeded)
    claim = store.claim(job.id, second_token, worker="w2", device_id="d2")
    assert claim.run and claim.attempt == 2 and claim.resume
    time.sleep(0.4)
    assert store.sweep_expired_leases() == []  # max_attempts=2 reached: failed, not requeued
    failed = store.get(job.id)
    assert failed.status is JobStatus.failed and "gave up after 2 attempts" in failed.error


def test_renewed_lease_is_not_swept(store: JobStore, sent: list) -> None:
    job, _ = _create(store)
    store.claim(job.id, sent[0][1], worker="w", device_id="d")
    for _ in range(4):
        time.sleep(0.15)
        assert store.renew_lease(job.id, sent[0][1])
        assert store.sweep_expired_leases() == []


def test_idempotency_key_returns_the_first_job(store: JobStore, sent: list) -> None:
    first, created = _create(store, idempotency_key="abc")
    again, created_again = _create(store, idempotency_key="abc")
    assert created and not created_again and again.id == first.id and len(sent) == 1


def test_list_newest_first_with_cursor_and_filter(store: JobStore, sent: list) -> None:
    ids = [_create(store)[0].id for _ in range(5)]
    store.request_cancel(ids[1])
    page = store.list(limit=2)
    assert [j.id for j in page.jobs] == ids[::-1][:2] and page.next_cursor == ids[3]
    rest = store.list(limit=10, cursor=page.next_cursor)
    assert [j.id for j in rest.jobs] == ids[::-1][2:] and rest.next_cursor is None
    assert [j.id for j in store.list(status=JobStatus.cancelled).jobs] == [ids[1]]
    assert len(store.list(status=JobStatus.queued).jobs) == 4
