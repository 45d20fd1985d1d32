"""Redis connections. Created by whoever owns a process's lifetime, never at import.

Every client retries a command once on a broken connection, after a short pause: after Redis
restarts, each pooled connection is dead and would otherwise fail one request (a 503, a paused
step) before redis-py replaces it. A retried write whose first try did reach Redis runs twice,
so every write the job store retries this way is idempotent (core/jobs/).
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ConstantBackoff, ExponentialBackoff
from redis.retry import Retry

RECONNECT_PAUSE_S = 0.05
# What a Redis that is restarting, frozen or unreachable raises (BusyLoadingError, raised while
# it reloads its append-only file, is a ConnectionError): callers that pause rather than fail on
# an outage catch exactly these.
OUTAGE_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError,
                                              redis.exceptions.ReadOnlyError)


def connect(url: str, decode_responses: bool = True) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=decode_responses, health_check_interval=30,
                                retry=Retry(ConstantBackoff(RECONNECT_PAUSE_S), 1),
                                retry_on_error=[redis.ConnectionError])


def connect_async(url: str) -> aioredis.Redis:
    # The API's client rides out a Redis restart rather than failing the first request on each
    # dead pooled connection (found by `make compose-test`: after `docker compose restart redis`
    # an SSE stream or a /predict broke): a few retries, backed off up to 0.5 s.
    return aioredis.Redis.from_url(url, decode_responses=True, health_check_interval=30,
                                   retry=AsyncRetry(ExponentialBackoff(cap=0.5, base=RECONNECT_PAUSE_S), 3),
                                   retry_on_error=[redis.ConnectionError])


def celery_broker_url(url: str) -> str:
    """kombu spells a unix-socket Redis `redis+socket://path?virtual_host=N`; redis-py `unix://path?db=N`."""
    parsed = urlparse(url)
    if parsed.scheme != "unix":
        return url
    db = parse_qs(parsed.query).get("db", ["0"])[0]
    return f"redis+socket://{parsed.path}?virtual_host={db}"
