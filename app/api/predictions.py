"""The API's side of a prediction: read and check the request, pick a live worker, send, wait (bounded).

A request is checked once, as its body streams in (app/api/multipart.py: sizes, counts, each
image's header as soon as its part is complete; `PredictCall`: the fields), and its bytes are
admitted against the process's memory budget (app/api/body_budget.py). The body's buffer, with a
header appended, is the message itself (core/wire.PredictRequest): the images are never copied,
re-encoded or held twice, and a request sent again is the same bytes.

Requests travel on a Redis list per device (RPUSH here, BLPOP in the worker's intake) and the
answer comes back to this process's inbox (app/api/reply_inbox.py), all over the API's async
Redis client: no thread is parked per request. A request costs one script (it checks that the
job succeeded and queues the request, atomically), and the scripts of the requests that arrive in
one turn of the event loop go to Redis in one pipeline (app/api/coalesced_scripts.py), written
once without a copy of the bodies and never retried (core/redis.execute_once), so a request is
queued once however slow the link or late Redis's answer. The
worker's reply body, which names the alias when one was asked for, is the HTTP body as is.

A worker that dies holding requests (SIGKILL, OOM, a lost host) does not answer them, and the
ones still on its list would wait for a process that is not coming back: `PredictionClient`
watches the requests in flight against the live workers (app/api/live_devices.py), and a request
whose worker process is gone is taken back off its list and sent again to a live worker, keeping
its id and deadline. Predictions are pure, so a request that ends up computed twice (its worker
was only frozen) costs time, not correctness: the first answer wins and the other is dropped.

A request may name an alias instead of a job (core/aliases.py): the name is resolved to a job id,
and the script that queues the request first checks that the alias still points there (else the
request is resolved again), so a request is answered by the one job it was queued for, and the
alias's move and the request's queueing are ordered by Redis itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from PIL import Image
from starlette.requests import Request

from app.api.body_budget import BodyBudget
from app.api.coalesced_scripts import CoalescedScripts
from app.api.live_devices import LiveDevices
from app.api.multipart import NO_IMAGE, FormLimits, PredictForm, read_predict_form
from app.api.reply_inbox import ReplyInbox
from core import keys
from core.aliases import validate_alias_name
from core.config import Settings
from core.defaults import MAX_TOP_K, TOP_K
from core.errors import Conflict, InvalidInput, NotFound, TooLarge, TorchyardError, Unavailable, UnsupportedMedia
from core.images import IMAGE_FORMATS, IMAGE_FORMATS_TEXT, OPENED_FORMATS, ViewReader
from core.redis import execute_once
from core.schemas import Device, JobStatus
from core.storage import validate_id
from core.wire import PredictHeader, PredictReply, PredictRequest

log = logging.getLogger(__name__)

# How often the requests in flight are checked against the workers that hold them: a request whose
# worker process is gone is sent again within this (plus the live view's age) of its heartbeat lapsing.
WATCH_S = 1.0

# Queue the request only if the job succeeded; return its status either way (nil: no such job).
_QUEUE_IF_SUCCEEDED = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == ARGV[1] then
  redis.call('RPUSH', KEYS[2], ARGV[2])
end
return status
"""
# The same for a request that named an alias: queue it only while the alias still points at the job
# it was resolved to (ARGV[2]); MOVED otherwise, and the caller resolves the name again.
_MOVED = "~moved"
_QUEUE_IF_ALIAS_STILL_THERE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return '""" + _MOVED + """'
end
local status = redis.call('HGET', KEYS[2], 'status')
if status == ARGV[3] then
  redis.call('RPUSH', KEYS[3], ARGV[4])
end
return status
"""
ALIAS_RESOLVE_TRIES = 5


class NoLiveWorker(Unavailable):
    """No worker is alive to take a request: a 503 for a new request, a wait for one sent again."""


@dataclass(frozen=True)
class PredictCall:
    """A /predict request, checked: exactly one of job_id and alias, top_k, at least one image."""

    job_id: str | None
    alias: str | None
    top_k: int
    form: PredictForm

    @classmethod
    def from_form(cls, form: PredictForm) -> PredictCall:
        job_id, alias = form.fields.get("job_id") or None, form.fields.get("alias") or None
        if (job_id is None) == (alias is None):
            raise InvalidInput("send exactly one of the form fields job_id and alias")
        if alias is not None:
            validate_alias_name(alias)
        else:
            validate_id(job_id or "", "job_id")
        try:
            top_k = int(form.fields.get("top_k", str(TOP_K)))
        except ValueError:
            raise InvalidInput(f"top_k: must be an integer between 1 and {MAX_TOP_K}") from None
        if not 1 <= top_k <= MAX_TOP_K:
            raise InvalidInput(f"top_k: must be an integer between 1 and {MAX_TOP_K}")
        if not form.images:
            raise InvalidInput(f"file: {NO_IMAGE}")
        return cls(job_id, alias, top_k, form)


def check_image(filename: str | None, data: bytes | memoryview, max_pixels: int) -> None:
    """Cheap gatekeeping from the header alone (the worker does the full decode): an allowed format,
    at most `max_pixels`. Reads the bytes in place: a 10 MiB image is not copied to be looked at."""
    name = filename or "image"
    try:
        with Image.open(io.BufferedReader(ViewReader(data)), formats=IMAGE_FORMATS) as probe:  # no other plugin runs
            fmt, (width, height) = probe.format, probe.size
    except Image.DecompressionBombError:
        raise TooLarge(f"{name} has too many pixels; the limit is {max_pixels} (TORCHYARD_MAX_IMAGE_PIXELS)") from None
    except Exception:
        raise UnsupportedMedia(f"{filename or 'file'} is not an image ({IMAGE_FORMATS_TEXT})") from None
    if fmt not in OPENED_FORMATS:
        raise UnsupportedMedia(f"{filename or 'file'} is {fmt}; send {IMAGE_FORMATS_TEXT}")
    if width * height > max_pixels:
        raise TooLarge(f"{name} has {width * height} pixels; the limit is {max_pixels} (TORCHYARD_MAX_IMAGE_PIXELS)")


@dataclass(slots=True)
class _InFlight:
    """A request while its caller waits: its message, and what it takes to send it again."""

    call: PredictCall
    request_id: str
    deadline: float  # Redis's clock: kept when the request is sent again
    answer: asyncio.Future[PredictReply]
    payload_end: int  # the body's length in the buffer, before the header
    job_id: str | None = None  # the job the message is framed for (an alias's, resolved)
    message: memoryview | None = None
    # (device id, worker instance) whose list it went to, or may have (its queueing's answer was lost); None: none
    holder: tuple[str, str] | None = None


class PredictionClient:
    def __init__(self, client: aioredis.Redis, settings: Settings) -> None:
        self.redis = client
        self.timeout_s = settings.predict_timeout_s
        self.max_pixels = settings.max_image_pixels
        self.limits = FormLimits(max_images=settings.max_images_per_request, max_image_bytes=settings.max_image_bytes,
                                 max_body_bytes=settings.max_predict_request_bytes)
        self.budget = BodyBudget(settings.predict_memory_budget_bytes, settings.predict_memory_per_client_limit)
        self.live = LiveDevices(client, self.timeout_s)
        self._in_flight: dict[str, _InFlight] = {}
        self._watcher: asyncio.Task[None] | None = None
        self.on_orphaned: Callable[[float], None] = lambda count: None  # the app counts them (/metrics)
        self._turn = itertools.count()
        self._scripts = CoalescedScripts(client)
        self._queue_if_succeeded = client.register_script(_QUEUE_IF_SUCCEEDED)
        self._queue_if_alias_still_there = client.register_script(_QUEUE_IF_ALIAS_STILL_THERE)
        self.inbox = ReplyInbox(client)

    async def close(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await self.inbox.close()

    async def answer(self, request: Request) -> bytes:
        """POST /predict: the JSON body of a PredictResponse, as the worker wrote it."""
        # Reserved as the bytes arrive, never for a declared length (app/api/body_budget.py says why).
        reservation = self.budget.reservation(request.client.host if request.client else "")
        try:
            form = await read_predict_form(request, self.limits, self._check_image, on_bytes=reservation.reserve)
            return await self.predict(PredictCall.from_form(form))
        finally:
            reservation.release()

    def _check_image(self, filename: str | None, data: memoryview) -> None:
        check_image(filename, data, self.max_pixels)

    async def predict(self, call: PredictCall) -> bytes:
        request_id, answer = self.inbox.expect(self.timeout_s)
        await self.live.read()  # Redis's clock is known from here on
        flight = _InFlight(call, request_id, self.live.clock.now() + self.timeout_s, answer, len(call.form.buffer))
        try:
            await self._send(flight)
            self._in_flight[request_id] = flight
            if self._watcher is None or self._watcher.done():
                self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="torchyard-predict-watch")
            try:
                reply = await answer
            except TimeoutError:
                self.live.forget()  # look again next time: this worker may be gone
                if flight.holder is None:  # its worker went away, and no other came back in time
                    raise Unavailable(f"no worker was alive to take the request again within {self.timeout_s:g}s "
                                      f"(its worker went away)") from None
                raise Unavailable(f"the worker of {flight.holder[0]} did not answer within {self.timeout_s:g}s") from None
        finally:
            self._in_flight.pop(request_id, None)
            self.inbox.forget(request_id, answer)
        reply.raise_for_status()
        return reply.body.encode()

    def _frame(self, flight: _InFlight, job_id: str) -> memoryview:
        """The message for `job_id`: the body's buffer with the header appended, built once. Only a
        request whose alias moved to another job meanwhile is framed again, on a copy of the body
        (the old message may still be on a list, to be taken back by its exact bytes)."""
        if flight.message is not None and flight.job_id == job_id:
            return flight.message
        call = flight.call
        buffer = call.form.buffer if flight.message is None else bytearray(flight.message[:flight.payload_end])
        header = PredictHeader(job_id=job_id, alias=call.alias, top_k=call.top_k, reply_to=self.inbox.key,
                               request_id=flight.request_id, queued_at=self.live.clock.now(), deadline=flight.deadline,
                               images=call.form.images)
        flight.message, flight.job_id = PredictRequest.frame_in_place(buffer, header), job_id
        return flight.message

    async def _send(self, flight: _InFlight) -> None:
        """Queue `flight` on a live worker (its alias resolved anew); 404, 409 or 503 when it cannot be."""
        alias = flight.call.alias
        for _ in range(ALIAS_RESOLVE_TRIES):
            job_id = await self._resolve(alias) if alias is not None else flight.call.job_id
            assert job_id is not None
            status = await self._queue(flight, job_id)
            if status != _MOVED:
                break
        else:
            raise Unavailable(f"alias {alias} moved {ALIAS_RESOLVE_TRIES} times while this request was queued; retry")
        self._check_status(job_id, status)

    async def _watch(self) -> None:
        """While requests are in flight: every WATCH_S, send again those whose worker process is gone."""
        while self._in_flight:
            await asyncio.sleep(WATCH_S)
            try:
                await self._resend_orphans()
            except Exception:  # Redis away: the inbox fails the waiting requests meanwhile
                log.warning("checking the predictions in flight failed; retrying", exc_info=True)

    async def _resend_orphans(self) -> None:
        flights = [flight for flight in self._in_flight.values() if not flight.answer.done()]
        if not flights:
            return
        live = await self.live.read()
        gone: dict[str, int] = {}
        for flight in flights:
            if flight.holder is not None and self.live.holder(flight.holder[0]) == flight.holder[1]:
                continue  # its worker is alive: it is computing it, or will
            if flight.holder is not None:
                device_id = flight.holder[0]
                # Not taken yet: no process computes it later. Taken: it died with its worker.
                await self._take_back(device_id, flight)
                flight.holder = None
                gone[device_id] = gone.get(device_id, 0) + 1
            if not live or flight.answer.done() or self.live.clock.now() >= flight.deadline:
                continue  # no worker now: the next round tries again, until the request's deadline
            try:
                await self._send(flight)
            except NoLiveWorker:
                continue  # they went away since this round began: the next round tries again
            except TorchyardError as exc:  # the job was deleted meanwhile, ...: that is the answer now
                if not flight.answer.done():
                    flight.answer.set_exception(exc)
                continue
            if flight.request_id not in self._in_flight and flight.holder is not None:
                # Its caller went away (answered by the first copy, or gone) while this one was sent.
                await self._take_back(flight.holder[0], flight)
        for device_id, count in gone.items():
            self.on_orphaned(count)
            log.warning("%d prediction request(s) held by the worker of %s, whose process is gone, sent again",
                        count, device_id)

    async def _take_back(self, device_id: str, flight: _InFlight) -> None:
        """Remove the request's message from the device's list, if it is still there: an LREM of its
        exact bytes, written without a copy (core/redis.execute_once)."""
        (removed,) = await execute_once(self.redis, [("LREM", keys.predict_queue(device_id), 1, flight.message)])
        if isinstance(removed, Exception):
            raise removed

    async def _resolve(self, alias: str) -> str:
        job_id = await self.redis.hget(keys.ALIASES, alias)
        if job_id is None:
            raise NotFound(f"alias {alias} not found")
        return job_id

    async def _queue(self, flight: _InFlight, job_id: str) -> str | None:
        """Queue the request for `job_id` on a live device if the job succeeded (and the alias still
        names it): the job's status or _MOVED. Records where it went in `flight`."""
        live = await self.live.read()
        if not live:  # still say 404 / 409 first: they do not depend on a worker
            self._check_status(job_id, await self.redis.hget(keys.job(job_id), "status"))
            raise NoLiveWorker("no live worker can serve predictions; start one with `torchyard worker`",
                               retry_after_s=2)
        device = self._pick_device(job_id, live)
        message = self._frame(flight, job_id)
        alias = flight.call.alias
        # Where the message may be from here on: should the script's answer be lost (a timeout, a broken
        # connection), it may have run, and the watcher takes it back from there before sending it
        # again, rather than leave a second copy on a list.
        flight.holder = (device.id, self.live.holder(device.id) or "")
        if alias is None:
            status = await self._scripts.run(self._queue_if_succeeded, [keys.job(job_id), keys.predict_queue(device.id)],
                                             [JobStatus.succeeded.value, message])
        else:
            status = await self._scripts.run(self._queue_if_alias_still_there,
                                             [keys.ALIASES, keys.job(job_id), keys.predict_queue(device.id)],
                                             [alias, job_id, JobStatus.succeeded.value, message])
        if status != JobStatus.succeeded.value:
            flight.holder = None  # not queued
        return status

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
