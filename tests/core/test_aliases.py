"""The alias store against a real Redis: a move is refused unless its target is a succeeded training
job at that moment; moves, rollbacks and deletes are recorded; job_is_aliased names the protectors."""

from __future__ import annotations

import pytest
import redis

from core.aliases import AliasStore, Caller, job_is_aliased, validate_alias_name
from core.errors import Conflict, InvalidInput, NotFound
from core.jobs import JobStore
from core.schemas import JobKind, JobStatus
from tests.core.kinds.examples import params_for


@pytest.fixture
def client(clean_redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(clean_redis_url, decode_responses=True)


def _job(client: redis.Redis, status: JobStatus, kind: JobKind = JobKind.train) -> str:
    """A job driven through the real store to `status` (claim → finish)."""
    store = JobStore(client, lambda delivery: None)
    job, _ = store.create(model="cifar_net", dataset="fake", params=params_for(kind), requested_device="auto")
    if status is JobStatus.queued:
        return job.id
    token = client.hget(f"ty:job:{job.id}", "delivery")
    assert store.claim(job.id, token, worker="w", device_id="n/cpu").run
    if status is not JobStatus.running:
        assert store.finish(job.id, token, status)
    return job.id


def test_names() -> None:
    for good in ("pets", "pets-v2", "a", "team.pets_prod", "0"):
        assert validate_alias_name(good) == good
    for bad in ("", "Pets", "-pets", "pets-", "a..b", "a/b", "x" * 65, "pets prod", "pets\n"):
        with pytest.raises(InvalidInput):
            validate_alias_name(bad)


def test_only_a_succeeded_training_job_can_be_a_target(client: redis.Redis) -> None:
    store = AliasStore(client)
    for status in (JobStatus.queued, JobStatus.running, JobStatus.failed, JobStatus.cancelled):
        with pytest.raises(Conflict):
            store.move("pets", _job(client, status), Caller())
    with pytest.raises(Conflict, match="training job"):
        store.move("pets", _job(client, JobStatus.succeeded, JobKind.export), Caller())
    with pytest.raises(NotFound):
        store.move("pets", "00000000000000nosuchjob", Caller())
    assert client.hgetall("ty:aliases") == {} and not client.exists("ty:alias:pets:history")


def test_job_is_aliased_until_every_alias_moves_away(client: redis.Redis) -> None:
    store = AliasStore(client)
    a, b = _job(client, JobStatus.succeeded), _job(client, JobStatus.succeeded)
    assert job_is_aliased(client, a) == []
    store.move("pets", a, Caller(address="10.0.0.1", user_agent="ci", note="v1"))
    store.move("pets-canary", a, Caller())
    assert job_is_aliased(client, a) == ["pets", "pets-canary"]
    store.move("pets", b, Caller())
    assert job_is_aliased(client, a) == ["pets-canary"] and job_is_aliased(client, b) == ["pets"]
    store.delete("pets-canary", Caller(note="done"))
    assert job_is_aliased(client, a) == []
    history = store.history("pets-canary").moves
    assert [(m.action, m.from_job_id, m.to_job_id) for m in history] == [("delete", a, None), ("set", None, a)]
    first = store.history("pets").moves[-1]
    assert (first.by, first.user_agent, first.note) == ("10.0.0.1", "ci", "v1")


def test_a_move_to_the_same_target_keeps_the_way_back(client: redis.Redis) -> None:
    store = AliasStore(client)
    a, b = _job(client, JobStatus.succeeded), _job(client, JobStatus.succeeded)
    store.move("pets", a, Caller())
    store.move("pets", b, Caller())
    again = store.move("pets", b, Caller())
    assert (again.job_id, again.previous_job_id, again.moves) == (b, a, 3)
