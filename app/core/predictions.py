"""The API's side of a prediction: check the job, pick a live worker, send, wait (bounded).

Requests travel on a Redis list per device (RPUSH here, BLPOP in the worker's inference
thread) and the answer comes back on a one-off reply list, all over the API's async Redis
client: no thread is parked per request and the round trip is two Redis calls (a script checks
that the job succeeded and queues the request in one). The worker's reply body is passed
through as the HTTP body, not parsed and re-serialised (wire format in worker/inference.py).
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import secrets
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from PIL import Image

from app.core.devices import DEVICES_INDEX, alive_key, predict_queue, state_key
from app.core.errors import Conflict, InvalidInput, NotFound, TooLarge, Unavailable, UnsupportedMedia
from app.core.jobs import job_key
from app.core.redis import KEY_PREFIX
from app.core.schemas import Device, JobStatus
from app.core.storage import validate_id

ACCEPTED_FORMATS = {"PNG", "JPEG", "WEBP", "BMP", "GIF", "MPO"}
LIVE_CACHE_S = 0.5

# Queue the request only if the job succeeded; return its status either way (nil: no such job).
_QUEUE_IF_SUCCEEDED = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == ARGV[1] then
  redis.call('RPUSH', KEYS[2], ARGV[2])
end
return status
"""


@dataclass(frozen=True)
class UploadedImage:
    filename: str | None
    data: bytes


def check_image(image: UploadedImage, max_bytes: int, max_pixels: int) -> None:
    """Cheap gatekeeping from the header alone; the worker does the full decode."""
    if len(image.data) > max_bytes:
        raise TooLarge(f"{image.filename or 'image'} is {len(image.data)} bytes; the limit is {max_bytes}")
    try:
        with Image.open(io.BytesIO(image.data)) as probe:
            fmt, (width, height) = probe.format, probe.size
    except Image.DecompressionBombError as exc:
        raise TooLarge(f"{image.filename or 'image'}: {exc}") from None
    except Exception:
        raise UnsupportedMedia(f"{image.filename or 'file'} is not an image (PNG, JPEG, WebP, BMP or GIF)") from None
    if fmt not in ACCEPTED_FORMATS:
        raise UnsupportedMedia(f"{image.filename or 'file'} is {fmt}; send PNG, JPEG, WebP, BMP or GIF")
    if width * height > max_pixels:
        raise TooLarge(f"{image.filename or 'image'} has {width * height} pixels; the limit is {max_pixels}")


class PredictionClient:
    def __init__(self, client: aioredis.Redis, *, timeout_s: float, max_bytes: int, max_pixels: int,
                 max_images: int) -> None:
        self.redis = client
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels
        self.max_images = max_images
        self._live: list[Device] = []
        self._live_at = 0.0
        self._turn = itertools.count()
        self._queue_if_succeeded = client.register_script(_QUEUE_IF_SUCCEEDED)

    async def predict(self, job_id: str, images: list[UploadedImage], top_k: int) -> bytes:
        """The JSON body of a PredictResponse, as the worker wrote it."""
        if not images:
            raise InvalidInput("send at least one image as a `file` part")
        if len(images) > self.max_images:
            raise TooLarge(f"{len(images)} images in one request; the limit is {self.max_images}")
        if not 1 <= top_k <= 1000:
            raise InvalidInput("top_k must be between 1 and 1000")
        validate_id(job_id, "job_id")
        for image in images:
            check_image(image, self.max_bytes, self.max_pixels)
        live = await self._live_devices()
        if not live:  # still say 404 / 409 first: they do not depend on a worker
            self._check_status(job_id, await self.redis.hget(job_key(job_id), "status"))
            raise Unavailable("no live worker can serve predictions; start one with `torchyard worker`")
        device = self._pick_device(job_id, live)
        reply_to = f"{KEY_PREFIX}reply:{secrets.token_hex(12)}"
        now = time.time()
        request = {"job_id": job_id, "top_k": top_k, "reply_to": reply_to, "t": now, "deadline": now + self.timeout_s,
                   "images": [{"filename": i.filename, "data": base64.b64encode(i.data).decode()} for i in images]}
        status = await self._queue_if_succeeded(keys=[job_key(job_id), predict_queue(device.id)],
                                                args=[JobStatus.succeeded.value, json.dumps(request)])
        self._check_status(job_id, status)
        answer = await self.redis.blpop([reply_to], timeout=self.timeout_s)
        if answer is None:
            self._live_at = 0.0  # look again next time: this worker may be gone
            raise Unavailable(f"worker {device.worker} ({device.id}) did not answer within {self.timeout_s:g}s")
        code, _, body = answer[1].partition(" ")
        if code != "200":
            raise _ERRORS.get(int(code), Unavailable)(json.loads(body)["detail"])
        return body.encode()

    @staticmethod
    def _check_status(job_id: str, status: str | None) -> None:
        if status is None:
            raise NotFound(f"job {job_id} not found")
        if status != JobStatus.succeeded.value:
            raise Conflict(f"job {job_id} is {status}; only a succeeded job can predict")

    def _pick_device(self, job_id: str, live: list[Device]) -> Device:
        """Prefer a worker that already holds the model, then an idle one; rotate among equals."""
        best = min(d.status != "idle" for d in live) if not any(job_id in d.loaded_models for d in live) else None
        if best is None:
            candidates = [d for d in live if job_id in d.loaded_models]
        else:
            candidates = [d for d in live if (d.status != "idle") == best]
        return candidates[next(self._turn) % len(candidates)]

    async def _live_devices(self) -> list[Device]:
        if time.monotonic() - self._live_at < LIVE_CACHE_S:
            return self._live
        ids = sorted(await self.redis.smembers(DEVICES_INDEX))
        live: list[Device] = []
        if ids:
            pipe = self.redis.pipeline(transaction=False)
            for device_id in ids:
                pipe.get(state_key(device_id))
                pipe.exists(alive_key(device_id))
            replies = await pipe.execute()
            live = [Device.model_validate_json(raw) for raw, alive in zip(replies[0::2], replies[1::2], strict=True)
                    if raw and alive]
        self._live, self._live_at = live, time.monotonic()
        return live


_ERRORS = {404: NotFound, 409: Conflict, 413: TooLarge, 415: UnsupportedMedia, 422: InvalidInput}
