"""API keys: created by an admin, stored only as a salted hash, looked up by id, revoked.

A secret is `tyk_<id>_<43 random characters>` (256 bits from `secrets`). The id in it finds the
record with one HGETALL, so checking a key costs one Redis read whatever the number of keys, and
a guessed id gains nothing without the random part. What is stored is HMAC-SHA256(salt, secret)
with a random 16-byte salt per key: a deliberately slow hash (scrypt, PBKDF2) protects
low-entropy passwords from guessing after a leak of the hashes, but a 256-bit random token cannot
be guessed however fast the hash, and a slow one would cost every request (the /predict hot path)
milliseconds of CPU. The salt keeps two stores' hashes of one secret apart. Digests are compared
with hmac.compare_digest. Neither the secret nor its digest is ever logged or answered (KeyInfo
has no field for them); the secret is returned once, by `create`.

Revocation and expiry are fields of the record (it stays, so the audit log and GET /keys still
name the key): the API's gate (app/api/access.py) reads the record at most `CACHE_S` after a
revocation, so every API process refuses a revoked key within a second.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
import redis.asyncio as aioredis

from core import keys
from core.access.models import DEFAULT_PROJECT, KeyCreate, KeyCreated, KeyInfo
from core.access.roles import Role
from core.errors import NotFound

SECRET_PREFIX = "tyk_"
_SECRET = re.compile(r"tyk_([0-9a-f]{12})_[A-Za-z0-9_-]{43}")
DAY_S = 86_400.0


@dataclass(frozen=True)
class Principal:
    """Who a request is: the key's id (None: the bootstrap key or no key at all), name, role, project."""

    key_id: str | None
    name: str
    role: Role
    project: str


# No key set: access control is off, as before keys existed; the bootstrap key: the first admin.
OPEN = Principal(None, "anyone (no TORCHYARD_API_KEY set)", Role.admin, DEFAULT_PROJECT)
BOOTSTRAP = Principal("bootstrap", "TORCHYARD_API_KEY", Role.admin, DEFAULT_PROJECT)


def digest(salt: bytes, secret: str) -> str:
    return hmac.new(salt, secret.encode(), hashlib.sha256).hexdigest()


def key_id_of(secret: str) -> str | None:
    """The id a well-formed secret names, or None (then no lookup is made)."""
    found = _SECRET.fullmatch(secret)
    return found[1] if found else None


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()


def info(record: dict[str, str], now: float | None = None) -> KeyInfo:
    now = time.time() if now is None else now
    expires = float(record["expires_at_s"]) if record.get("expires_at_s") else None
    return KeyInfo(id=record["id"], name=record["name"], role=Role(record["role"]), project=record["project"],
                   created_at=datetime.fromisoformat(record["created_at"]),
                   created_by=record.get("created_by") or None,
                   expires_at=datetime.fromtimestamp(expires, UTC) if expires is not None else None,
                   revoked_at=datetime.fromisoformat(record["revoked_at"]) if record.get("revoked_at") else None,
                   active=not record.get("revoked_at") and (expires is None or expires > now))


def verify(record: dict[str, str], secret: str, now: float) -> Principal | None:
    """The principal of `secret` if `record` is its key and the key is active, else None."""
    if not record or "digest" not in record:
        return None
    given = digest(bytes.fromhex(record["salt"]), secret)
    if not hmac.compare_digest(given, record["digest"]):
        return None
    if record.get("revoked_at"):
        return None
    if record.get("expires_at_s") and float(record["expires_at_s"]) <= now:
        return None
    return Principal(record["id"], record["name"], Role(record["role"]), record["project"])


def _decoded(raw: dict[Any, Any]) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}


class KeyStore:
    """The keys' records (ty:apikey:<id>, indexed in ty:apikeys), for the admin's routes."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def create(self, request: KeyCreate, created_by: str | None) -> KeyCreated:
        key_id = secrets.token_hex(6)
        secret = f"{SECRET_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        salt = secrets.token_bytes(16)
        now = time.time()
        record = {"id": key_id, "name": request.name, "role": request.role.value, "project": request.project,
                  "salt": salt.hex(), "digest": digest(salt, secret), "created_at": _iso(now),
                  "created_by": created_by or "",
                  "expires_at_s": repr(now + request.expires_in_days * DAY_S) if request.expires_in_days else ""}
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.api_key(key_id), mapping=record)
            pipe.zadd(keys.API_KEYS_INDEX, {key_id: now})
            pipe.execute()
        return KeyCreated(**info(record, now).model_dump(), secret=secret)

    def list(self) -> list[KeyInfo]:
        ids = [i.decode() if isinstance(i, bytes) else i for i in self.redis.zrange(keys.API_KEYS_INDEX, 0, -1)]
        with self.redis.pipeline(transaction=False) as pipe:
            for key_id in ids:
                pipe.hgetall(keys.api_key(key_id))
            records = [_decoded(raw) for raw in pipe.execute()]
        now = time.time()
        return [info(record, now) for record in records if record]

    def revoke(self, key_id: str) -> KeyInfo:
        """Mark the key revoked (idempotent: a second revoke keeps the first time). NotFound for no such key."""
        name = keys.api_key(key_id)
        if not re.fullmatch(r"[0-9a-f]{12}", key_id) or not self.redis.exists(name):
            raise NotFound(f"no key has id {key_id!r}; GET /keys lists them")
        self.redis.hsetnx(name, "revoked_at", _iso(time.time()))  # a record is never deleted: no race
        return info(_decoded(self.redis.hgetall(name)))


async def fetch_record(client: aioredis.Redis, key_id: str) -> dict[str, str]:
    """One key's record, for the gate's lookup (empty when there is none)."""
    return _decoded(await client.hgetall(keys.api_key(key_id)))
