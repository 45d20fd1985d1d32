"""The role table (core/access/roles.py) names every operation of the OpenAPI document and no
other; the gate's key check reads a key's record again once it is CACHE_S old, so a revocation
reaches every API process within a second (a clock of the test's own, a real Redis)."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis

from app.api.access import CACHE_S, KeyCheck
from app.main import create_app
from core.access.keystore import BOOTSTRAP, OPEN, KeyStore
from core.access.models import KeyCreate
from core.access.roles import POLICY, SUBTREES, Ability, Role, allows
from core.config import Settings

SETTINGS = Settings(_env_file=None, redis_url="redis://127.0.0.1:1/0", api_key="bootstrap-secret")


def test_the_role_table_names_every_operation_and_no_other() -> None:
    spec = create_app(SETTINGS).openapi()
    operations = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops} - {("GET", "/healthz")}
    named = {(m, p) for m, p in POLICY if p not in SUBTREES}
    assert operations == named, operations ^ named
    for role in Role:  # admin may do everything; the others never manage keys nor read the audit
        assert all(allows(Role.admin, m, p) for m, p in POLICY)
        if role is not Role.admin:
            assert not allows(role, "POST", "/keys") and not allows(role, "GET", "/audit")
    assert not allows(Role.trainer, "GET", "/not/a/route")  # unnamed: admin only
    assert allows(Role.predictor, "POST", "/v2/models/m/infer") and not allows(Role.viewer, "POST", "/v2/models/m/infer")
    assert allows(Role.viewer, "GET", "/v2/models/m") and allows(Role.viewer, "HEAD", "/jobs")
    assert {POLICY[("GET", "/jobs/{job_id}/export")]} == {Ability.write}  # it builds an export: not a read


def test_a_revoked_key_is_refused_once_its_cached_record_is_half_a_second_old(clean_redis_url: str) -> None:
    made = KeyStore(redis.Redis.from_url(clean_redis_url)).create(
        KeyCreate(name="bot", role=Role.trainer, project="vision"), created_by=None)
    now = [100.0]
    check = KeyCheck(SETTINGS, clock=lambda: now[0])
    bearer = f"Bearer {made.secret}".encode()

    async def scenario() -> None:
        client = aioredis.Redis.from_url(clean_redis_url)
        try:
            who = await check.principal(bearer, lambda: client)
            assert who is not None and who.role is Role.trainer and who.project == "vision"
            assert await check.principal(b"Bearer bootstrap-secret", lambda: client) == BOOTSTRAP
            assert await check.principal(b"Bearer bootstrap-secre", lambda: client) is None
            assert await check.principal(None, lambda: client) is None
            KeyStore(redis.Redis.from_url(clean_redis_url)).revoke(made.id)
            now[0] += CACHE_S + 0.01
            assert await check.principal(bearer, lambda: client) is None
        finally:
            await client.aclose()

    assert CACHE_S < 1.0
    asyncio.run(scenario())


def test_without_a_key_set_everyone_is_the_admin_of_default() -> None:
    check = KeyCheck(Settings(_env_file=None, redis_url="redis://127.0.0.1:1/0"))

    async def scenario() -> None:
        assert await check.principal(None, lambda: None) == OPEN  # type: ignore[arg-type,return-value]

    asyncio.run(scenario())
    assert OPEN.role is Role.admin and OPEN.project == "default"
