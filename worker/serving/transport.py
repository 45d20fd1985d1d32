"""The transport stage: the device's request list in Redis, and the answers back to the API.

Requests are binary frames (core/wire.PredictRequest), so the list is read by a client that does
not decode responses; a request's images are sliced out of its frame, never base64-decoded. A
message's kind is decided by its structure, never by a prefix a client controls: a frame begins
with the request's body as the client sent it (a multipart preamble may hold any bytes, `preload `
among them) and ends with the trailer only the API writes, so a message with that trailer is a
prediction, and only one without it may be a preload request.
Answers go to the inbox of the API process that asked, one RPUSH per inbox for a whole batch.

The intake also keeps this process's estimate of Redis's clock (core/clock.RedisClock): the
requests' `queued_at` and `deadline` are on it, so a worker whose wall clock is off neither drops
live requests as expired nor holds a batch open for the skew.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import redis

from core import keys
from core.clock import RedisClock
from core.wire import REPLY_TTL_S, MalformedMessage, PredictReply, PredictRequest, PreloadRequest

log = logging.getLogger(__name__)

BLOCK_S = 1  # how long one BLPOP waits: bounds how late the intake sees a stop


class Transport:
    def __init__(self, client: redis.Redis, device_id: str) -> None:
        self.redis = client  # decode_responses=False: frames are bytes
        self.queue = keys.predict_queue(device_id)
        self.clock = RedisClock()

    def take_first(self, most: int) -> list[bytes]:
        """Block (up to BLOCK_S) for a first message, and take up to `most` in all."""
        if self.clock.due(time.monotonic()):
            self.clock.sample(self.redis)
        # BLPOP and an LPOP of what queued beside it, pipelined: Redis runs the LPOP as soon as the
        # BLPOP returns, so a lone request costs one round trip and a burst is taken whole.
        pipe = self.redis.pipeline(transaction=False)
        pipe.blpop([self.queue], timeout=BLOCK_S)
        pipe.lpop(self.queue, most - 1)
        first, rest = pipe.execute()
        return ([first[1]] if first is not None else []) + (rest or [])

    def take_more(self, most: int) -> list[bytes]:
        return (self.redis.lpop(self.queue, most) or []) if most > 0 else []

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
        """Addressed replies, by inbox: one RPUSH each."""
        pipe = self.redis.pipeline(transaction=False)
        for inbox, encoded in replies.items():
            pipe.rpush(inbox, *encoded)
            pipe.expire(inbox, REPLY_TTL_S)  # an API process that died: its inbox expires
        pipe.execute()

    def send_errors(self, requests: list[PredictRequest], status: int, detail: str) -> None:
        replies: dict[str, list[str]] = defaultdict(list)
        for request in requests:
            replies[request.header.reply_to].append(PredictReply.error(status, detail).encode_to(request.header.request_id))
        self.send(replies)

    def send_preload_reply(self, preload: PreloadRequest, reply: PredictReply) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(preload.reply_to, reply.encode())
        pipe.expire(preload.reply_to, REPLY_TTL_S)
        pipe.execute()
