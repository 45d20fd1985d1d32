"""Preloading a model where it is about to be needed: the API's side of the preload round trip.

Before an alias moves from job A to job B, B is loaded on every live device that holds A resident
(the devices its traffic goes to: /predict prefers a device that holds the model), so requests
after the move do not pay for the load or find it failing. A `core/wire.PreloadRequest` goes on each
such device's predict list, in order behind the predictions already queued there; the worker's
inference thread loads the model and answers on a one-off reply list. The wait is bounded: a
device that does not answer in `timeout_s` is reported as `timeout` and does not hold the move
back (it loads on its first request, as without preloading); a device that answers that it cannot
load the model (`failed`) makes the caller refuse the move. The HTTP contract reports each
device's preload as a `WarmResult` in the move's `warm` list (docs/api.md).
"""

from __future__ import annotations

import secrets
import time

import redis

from core import keys
from core.clock import redis_now
from core.devices import DeviceRegistry
from core.schemas import WarmResult
from core.wire import MalformedMessage, PredictErrorBody, PredictReply, PreloadedModel, PreloadRequest


class ModelPreloader:
    def __init__(self, client: redis.Redis, devices: DeviceRegistry, timeout_s: float) -> None:
        self.redis = client
        self.devices = devices
        self.timeout_s = timeout_s

    def __call__(self, job_id: str, where_resident: str) -> list[WarmResult]:
        """Load `job_id` on each live device that holds `where_resident`; one result per device."""
        targets = [d.id for d in self.devices.live() if where_resident in d.loaded_models]
        if not targets:
            return []
        started = time.monotonic()
        deadline = started + self.timeout_s
        # The worker compares the deadline with Redis's clock, never with this host's wall clock.
        expires = redis_now(self.redis) + self.timeout_s
        pending: dict[str, str] = {}  # reply list → device id
        pipe = self.redis.pipeline(transaction=False)
        for device_id in targets:
            reply_to = keys.predict_reply(secrets.token_hex(12))
            pipe.rpush(keys.predict_queue(device_id), PreloadRequest(job_id=job_id, reply_to=reply_to,
                                                                     deadline=expires).encode())
            pending[reply_to] = device_id
        pipe.execute()
        results: dict[str, WarmResult] = {}
        while pending:
            remaining = deadline - time.monotonic()
            answer = self.redis.blpop(list(pending), timeout=remaining) if remaining > 0 else None
            if answer is None:
                break
            device_id = pending.pop(answer[0])
            results[device_id] = _result(device_id, answer[1], time.monotonic() - started)
        for device_id in pending.values():  # a late answer expires with its list (REPLY_TTL_S)
            results[device_id] = WarmResult(device=device_id, status="timeout", seconds=round(self.timeout_s, 3),
                                            detail=f"no answer within {self.timeout_s:g}s; it loads on its first "
                                                   "request instead")
        return [results[d] for d in targets]


def _result(device_id: str, raw: str, waited_s: float) -> WarmResult:
    try:
        reply = PredictReply.decode(raw)
    except MalformedMessage as exc:
        return WarmResult(device=device_id, status="failed", detail=str(exc))
    if reply.status == 200:
        preloaded = PreloadedModel.model_validate_json(reply.body)
        return WarmResult(device=device_id, status="loaded" if preloaded.loaded else "resident",
                          seconds=round(waited_s, 4))
    try:
        detail = PredictErrorBody.model_validate_json(reply.body).detail
    except ValueError:
        detail = f"the worker answered {reply.status}"
    return WarmResult(device=device_id, status="failed", seconds=round(waited_s, 4), detail=detail)
