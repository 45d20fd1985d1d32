"""Redis connections. Created by whoever owns a process's lifetime, never at import.

Every client retries a command once on a broken connection, after a short pause: after Redis
restarts, each pooled connection is dead and would otherwise fail one request (a 503, a paused
step) before redis-py replaces it. A retried write whose first try did reach Redis runs twice,
so every write the job store retries this way is idempotent (core/jobs/). Writes that must not
run twice, and values too large to copy, go through `execute_once` instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any
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


# Pooled connections an API process may hold beyond one per open HTTP connection: its background
# tasks' (the engine's watcher, the sweeps' nudge wait, the devices' reads).
BACKGROUND_CONNECTIONS = 64


def connect_async(url: str, http_connections: int = 1024) -> aioredis.Redis:
    """The API's client. It rides out a Redis restart rather than failing the first request on each
    dead pooled connection (found by `make compose-test`: after `docker compose restart redis` an
    SSE stream or a /predict broke): a few retries, backed off up to 0.5 s.

    Its pool holds one connection per HTTP connection the process may have open (each has at most
    one request in flight, which waits on at most one Redis command at a time) and the background
    tasks': redis-py's asyncio pool defaults to 100 and refuses the 101st ("Too many connections"),
    which 128 clients of one busy API process reached (a 503 for requests nobody refused)."""
    return aioredis.Redis.from_url(url, decode_responses=True, health_check_interval=30,
                                   max_connections=http_connections + BACKGROUND_CONNECTIONS,
                                   retry=AsyncRetry(ExponentialBackoff(cap=0.5, base=RECONNECT_PAUSE_S), 3),
                                   retry_on_error=[redis.ConnectionError])


# The most of a command handed to the connection's transport at once by `execute_once`: a larger
# value goes in slices, each written under the client's socket timeout.
WRITE_SLICE_BYTES = 1 << 20


async def execute_once(client: aioredis.Redis, commands: Sequence[Sequence[Any]]) -> list[Any]:
    """Run `commands` in one round trip on one pooled connection, and never again: each reply, or
    the ResponseError Redis answered for it, in order; a broken or timed-out connection raises.

    Why not redis-py's own pipeline or command: (1) they retry on a timeout or a broken connection
    (the client's Retry), and a command whose bytes had all reached Redis has run, or will, so a
    retried RPUSH queues its value again; (2) the whole write must drain within one socket timeout,
    so a large value (a /predict request of 128 MiB) on a slow link times out, is retried, and may
    then run several times; (3) asyncio's own transport (where uvloop is not installed) joins the
    pieces it is given into one bytes object, copies what the socket did not take, and buffers that
    copy again: three copies of the value besides the caller's. Here the packed command (a
    memoryview stays a view: redis-py never joins one) is written in slices of WRITE_SLICE_BYTES,
    each under the socket timeout: a send takes as long as its size needs, as long as Redis keeps
    taking bytes, and holds at most a slice's copies. A connection taken from the pool is checked
    first (the pool reconnects one that Redis closed, as after a restart): nothing is written twice.
    """
    pool = client.connection_pool
    connection = await pool.get_connection()
    try:
        first = True
        for batch in _slices(connection.pack_commands(commands), WRITE_SLICE_BYTES):
            await connection.send_packed_command(batch, check_health=first)
            first = False
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await connection.read_response())
            except redis.ResponseError as exc:  # this command's own error: the others still answer
                replies.append(exc)
        return replies
    except BaseException:  # what was written, and what Redis answers, is unknown: the connection goes
        await connection.disconnect(nowait=True)
        raise
    finally:
        await pool.release(connection)


def _slices(pieces: Sequence[bytes | memoryview], most: int) -> Iterator[list[bytes | memoryview]]:
    """`pieces` regrouped into lists of at most `most` bytes; a larger piece is cut into views."""
    if sum(len(piece) for piece in pieces) <= most:  # the usual case: one write, as redis-py makes it
        yield list(pieces)
        return
    batch: list[bytes | memoryview] = []
    size = 0
    for piece in pieces:
        view = memoryview(piece)
        while view.nbytes:
            part = view[:most - size]
            batch.append(part)
            size += part.nbytes
            view = view[part.nbytes:]
            if size >= most:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def celery_broker_url(url: str) -> str:
    """kombu spells a unix-socket Redis `redis+socket://path?virtual_host=N`; redis-py `unix://path?db=N`."""
    parsed = urlparse(url)
    if parsed.scheme != "unix":
        return url
    db = parse_qs(parsed.query).get("db", ["0"])[0]
    return f"redis+socket://{parsed.path}?virtual_host={db}"
