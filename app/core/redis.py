"""Redis connections. Created by whoever owns a process's lifetime, never at import."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import redis
import redis.asyncio as aioredis

KEY_PREFIX = "ty:"


def connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True, health_check_interval=30)


def connect_async(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, decode_responses=True, health_check_interval=30)


def celery_broker_url(url: str) -> str:
    """kombu spells a unix-socket Redis `redis+socket://path?virtual_host=N`; redis-py `unix://path?db=N`."""
    parsed = urlparse(url)
    if parsed.scheme != "unix":
        return url
    db = parse_qs(parsed.query).get("db", ["0"])[0]
    return f"redis+socket://{parsed.path}?virtual_host={db}"
