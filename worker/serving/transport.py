"""The transport stage: the device's request list in Redis, and the answers back to the API.

Requests are binary frames (core/wire.PredictRequest), so the list is read by a client that does
not decode responses; a request's images are sliced out of its frame, never base64-decoded. A
message's kind is decided by its structure, never by a prefix a client controls: a frame begins
with the request's body as the client sent it (a multipart preamble may hold any bytes, `preload `
among them) and ends with the trailer only the API writes, so a message with that trailer is a
prediction, and only one without it may be a preload request.
Answers go to the inbox of the API process that asked, one RPUSH per inbox for a whole batch.

The intake's reads (a first message, then a poll every fraction of a millisecond while a batch
fills) go over a connection of their own (`ListReader`): each is a command packed once and sent
as is, where redis-py's command path (a pooled connection taken and given back, its retry and
observability wrappers) cost the worker three times as much CPU as the round trip itself, the
larger part of the intake's own CPU per request (docs/benchmarks.md, "The service's own CPU per
request"). The answers go the same way (`ReplyWriter`, a connection per sending thread): through
redis-py's pipeline they were a large share of the worker's Python time at one client.

The intake also keeps this process's estimate of Redis's clock (core/clock.RedisClock): the
requests' `queued_at` and `deadline` are on it, so a worker whose wall clock is off neither drops
live requests as expired nor holds a batch open for the skew.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

import redis

from core import keys
from core.clock import RedisClock
from core.redis import RECONNECT_PAUSE_S
from core.wire import REPLY_TTL_S, MalformedMessage, PredictReply, PredictRequest, PreloadRequest

log = logging.getLogger(__name__)

BLOCK_S = 1  # how long one BLPOP waits: bounds how late the intake sees a stop


class PackedConnection:
    """Commands written straight to one connection of their own and their replies read straight
    off it: no pooled connection taken and given back per command, no pipeline object, no
    per-command response callbacks (what redis-py's command and pipeline paths cost this process
    several times the round trip itself). One thread's: each thread that talks to Redis this way
    holds its own. A broken connection is dropped and the commands sent once more on a new one,
    as the client's own retry does (core/redis.py); a second failure is the caller's outage."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool = pool
        self._connection: redis.connection.AbstractConnection | None = None

    @property
    def connection(self) -> redis.connection.AbstractConnection:
        if self._connection is None:
            self._connection = self.pool.make_connection()
        return self._connection

    def run(self, *commands: list[bytes]) -> list[object]:
        """Send `commands` (packed) in one write; their replies, in order. An error reply is read
        with the rest (the connection stays in step) and then raised."""
        for attempt in (0, 1):
            connection = self.connection
            try:
                connection.send_packed_command([part for command in commands for part in command], check_health=False)
                replies: list[object] = []
                for _ in commands:
                    try:
                        replies.append(connection.read_response())
                    except redis.ResponseError as exc:
                        replies.append(exc)
            except (redis.ConnectionError, redis.TimeoutError):
                connection.disconnect()
                if attempt:
                    raise
                time.sleep(RECONNECT_PAUSE_S)
                continue
            for reply in replies:
                if isinstance(reply, redis.ResponseError):
                    raise reply
            return replies
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.disconnect()


class ListReader:
    """BLPOP and LPOP of one list on a connection of its own (`PackedConnection`), each command
    packed once (per count); the intake thread's."""

    def __init__(self, client: redis.Redis, queue: str) -> None:
        self.queue = queue
        self._direct = PackedConnection(client.connection_pool)
        self._packed: dict[tuple[str, int], list[bytes]] = {}

    def _pack(self, command: str, argument: int) -> list[bytes]:
        packed = self._packed.get((command, argument))
        if packed is None:
            packed = self._packed[(command, argument)] = self._direct.connection.pack_command(
                command, self.queue, argument)
        return packed

    def first(self, most: int) -> list[bytes]:
        """Block (up to BLOCK_S) for a first message, and take up to `most` in all: BLPOP and an
        LPOP of what queued beside it in one write, so a lone request costs one round trip and a
        burst is taken whole."""
        first, rest = self._direct.run(self._pack("BLPOP", BLOCK_S), self._pack("LPOP", most - 1))
        return ([first[1]] if first is not None else []) + (rest or [])  # type: ignore[index, operator]

    def more(self, most: int) -> list[bytes]:
        (taken,) = self._direct.run(self._pack("LPOP", most))
        return taken or []  # type: ignore[return-value]

    def close(self) -> None:
        self._direct.close()


class ReplyWriter:
    """Replies RPUSHed to their inboxes, each with its EXPIRE, in one write on the sending thread's
    own connection (`PackedConnection`): the device thread answers a small batch itself, the
    reply threads the rest, and each sends on its own. A thread's connection lives in a
    thread-local, so it is closed when its thread ends (redis-py disconnects a connection it
    collects), or with the writer."""

    def __init__(self, client: redis.Redis) -> None:
        self.pool = client.connection_pool
        self._local = threading.local()

    def send(self, replies: dict[str, list[str]]) -> None:
        direct: PackedConnection | None = getattr(self._local, "direct", None)
        if direct is None:
            direct = self._local.direct = PackedConnection(self.pool)
        pack = direct.connection.pack_command
        commands: list[list[bytes]] = []
        for inbox, encoded in replies.items():
            commands.append(pack("RPUSH", inbox, *encoded))
            commands.append(pack("EXPIRE", inbox, REPLY_TTL_S))  # an API process that died: its inbox expires
        if commands:
            direct.run(*commands)


class Transport:
    def __init__(self, client: redis.Redis, device_id: str) -> None:
        self.redis = client  # decode_responses=False: frames are bytes
        self.queue = keys.predict_queue(device_id)
        self.reader = ListReader(client, self.queue)
        self.writer = ReplyWriter(client)
        self.clock = RedisClock()

    def take_first(self, most: int) -> list[bytes]:
        """Block (up to BLOCK_S) for a first message, and take up to `most` in all."""
        if self.clock.due(time.monotonic()):
            self.clock.sample(self.redis)
        return self.reader.first(most)

    def take_more(self, most: int) -> list[bytes]:
        return self.reader.more(most) if most > 0 else []

    @staticmethod
    def decode(raw: list[bytes], requests: list[PredictRequest], preloads: list[PreloadRequest]) -> int:
        """Sort messages into predictions and preload requests; the images of the predictions added."""
        images = 0
        for item in raw:
            try:
                if not PredictRequest.is_frame(item) and PreloadRequest.is_preload(item):
                    preloads.append(PreloadRequest.decode(item))
                    continue
                request = PredictRequest.decode(item)
            except MalformedMessage as exc:
                log.warning("dropped a malformed message (%s): %.80r", exc, item[:80])
                continue
            images += request.image_count
            requests.append(request)
        return images

    def local_time(self, redis_time: float) -> float:
        return self.clock.to_local(redis_time)

    def send(self, replies: dict[str, list[str]]) -> None:
        """Addressed replies, by inbox: one RPUSH each, all in one write (`ReplyWriter`)."""
        self.writer.send(replies)

    def send_errors(self, requests: list[PredictRequest], status: int, detail: str) -> None:
        replies: dict[str, list[str]] = defaultdict(list)
        for request in requests:
            replies[request.header.reply_to].append(PredictReply.error(status, detail).encode_to(request.header.request_id))
        self.send(replies)

    def send_preload_reply(self, preload: PreloadRequest, reply: PredictReply) -> None:
        self.writer.send({preload.reply_to: [reply.encode()]})
