"""Keys against a real Redis: a secret is stored only as its salted hash, checked whole, and a
revoked or expired key checks as nobody; the audit log is capped and trimmed by age."""

from __future__ import annotations

import time

import pytest
import redis

from core.access import audit
from core.access.keystore import BOOTSTRAP, KeyStore, key_id_of, verify
from core.access.models import KeyCreate
from core.access.roles import Role
from core.errors import NotFound


@pytest.fixture
def client(clean_redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(clean_redis_url, decode_responses=True)


def _record(client: redis.Redis, key_id: str) -> dict[str, str]:
    return client.hgetall(f"ty:apikey:{key_id}")


def test_a_secret_is_stored_only_as_a_salted_hash(client: redis.Redis) -> None:
    store = KeyStore(client)
    first = store.create(KeyCreate(name="ci-bot", role=Role.predictor, project="vision"), created_by="bootstrap")
    second = store.create(KeyCreate(name="ci-bot", role=Role.predictor, project="vision"), created_by="bootstrap")
    assert first.secret != second.secret and key_id_of(first.secret) == first.id
    for key in client.scan_iter("*"):  # nothing anywhere in Redis holds the secret or its random part
        value = repr(client.hgetall(key) if client.type(key) == "hash" else client.dump(key))
        assert first.secret not in value and first.secret.split("_", 2)[2] not in value
    one, two = _record(client, first.id), _record(client, second.id)
    assert one["salt"] != two["salt"] and len(one["digest"]) == 64
    listed = store.list()
    assert [k.id for k in listed] == [first.id, second.id]
    assert all("secret" not in k.model_dump() for k in listed) and all(k.active for k in listed)


def test_only_the_whole_secret_of_an_active_key_checks(client: redis.Redis) -> None:
    store = KeyStore(client)
    made = store.create(KeyCreate(name="intern", role=Role.viewer, project="vision"), created_by=None)
    record, now = _record(client, made.id), time.time()
    who = verify(record, made.secret, now)
    assert who is not None and (who.key_id, who.role, who.project, who.name) == (made.id, Role.viewer, "vision",
                                                                                  "intern")
    last = made.secret[-1]
    for wrong in (made.secret[:-1], made.secret[:-1] + ("A" if last != "A" else "B"), made.secret + "x", ""):
        assert verify(record, wrong, now) is None, wrong
    assert key_id_of(made.secret[:-1]) is None and key_id_of("tyk_nothex00000_" + "a" * 43) is None
    store.revoke(made.id)
    assert verify(_record(client, made.id), made.secret, now) is None
    revoked = store.revoke(made.id)  # twice: the same state, the first time kept
    assert not revoked.active and revoked.revoked_at is not None
    with pytest.raises(NotFound):
        store.revoke("000000000000")
    with pytest.raises(NotFound):
        store.revoke("../etc")


def test_an_expired_key_checks_as_nobody(client: redis.Redis) -> None:
    store = KeyStore(client)
    made = store.create(KeyCreate(name="temp", role=Role.trainer, expires_in_days=1), created_by=None)
    record = _record(client, made.id)
    assert made.expires_at is not None and made.project == "default"
    assert verify(record, made.secret, time.time()) is not None
    assert verify(record, made.secret, made.expires_at.timestamp() + 1) is None
    assert not [k for k in store.list() if k.id == made.id and k.expires_at is None]


def test_the_audit_log_is_capped_and_trimmed_by_age(client: redis.Redis, clean_redis_url: str) -> None:
    import asyncio

    import redis.asyncio as aioredis

    async def write(n: int) -> None:
        aclient = aioredis.Redis.from_url(clean_redis_url)
        for k in range(n):
            await audit.record(aclient, 100, audit.entry_fields(BOOTSTRAP, "DELETE", "/jobs/{job_id}", f"job_id={k}",
                                                                204))
        await aclient.aclose()

    asyncio.run(write(400))
    assert 100 <= client.xlen("ty:audit") < 400  # approximate MAXLEN: about the cap, never the whole history
    newest = audit.read(client, 2)
    assert [e.object for e in newest] == ["job_id=399", "job_id=398"] and newest[0].key_name == "TORCHYARD_API_KEY"
    older = audit.read(client, 1, before=newest[-1].id)
    assert older[0].object == "job_id=397"
    assert audit.trim(client, time.time(), keep_days=1) == 0  # nothing is a day old
    assert audit.trim(client, time.time() + 2 * 86_400, keep_days=1) > 0 and client.xlen("ty:audit") == 0
