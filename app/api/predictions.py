"""The API's side of a prediction: check the job, pick a live worker, send, wait (bounded).

Requests travel on a Redis list per device (RPUSH here, BLPOP in the worker's inference
thread) and the answer comes back to this process's inbox (app/api/reply_inbox.py), all over the
API's async Redis client: no thread is parked per request. A request costs one script (it checks
that the job succeeded and queues the request, atomically), and the scripts of the requests that
arrive in one turn of the event loop go to Redis in one pipeline (`CoalescedScripts`). The
worker's reply body is passed through as the HTTP body, not parsed and re-serialised (the
messages are core/wire.py's).

A worker that dies holding requests (SIGKILL, OOM, a lost host) does not answer them, and the
ones still on its list would wait for a process that is not coming back: `PredictionClient`
watches the requests in flight against the live workers (each device's alive key names the worker
process holding it), and a request whose worker process is gone is taken back off its list and
sent again to a live worker, keeping its id and deadline. Predictions are pure, so a request that
ends up computed twice (its worker was only frozen) costs time, not correctness: the first answer
wins and the other is dropped.

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from PIL import Image
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from app.api.reply_inbox import ReplyInbox
from core import keys
from core.aliases import validate_alias_name
from core.devices import SERVING, alive_instances, devices_from_replies, liveness_reads
from core.errors import Conflict, InvalidInput, NotFound, TooLarge, TorchyardError, Unavailable, UnsupportedMedia
from core.images import IMAGE_FORMATS, IMAGE_FORMATS_TEXT, OPENED_FORMATS
from core.schemas import Device, JobStatus
from core.storage import validate_id
from core.wire import PredictReply, PredictRequest, WireImage, strict_json

log = logging.getLogger(__name__)

LIVE_CACHE_S = 0.5
LIVE_READ_TIMEOUT_S = 5.0
# How often the requests in flight are checked against the workers that hold them: a request whose
# worker process is gone is sent again within this (plus LIVE_CACHE_S) of the worker's heartbeat lapsing.
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
class _ScriptCall:
    script: AsyncScript
    keys: list[str]
    args: list[Any]
    result: asyncio.Future[Any]


class CoalescedScripts:
    """Lua scripts of concurrent callers, sent to Redis together: every call made in one turn of
    the event loop goes in one pipeline of EVALSHAs (not a transaction: each script is atomic on
    its own, exactly as when it is sent alone, and answers its own caller, errors included).

    Why: one command on redis-py's asyncio client costs this process more than the rest of a
    prediction's Redis work (a pooled connection taken and given back, the send and the read each
    under a timeout, its observability hooks), and under load requests arrive in bursts: a batch of
    answers from the worker releases its clients together, and they send their next requests
    together. Counted with callgrind (bench/api_instructions.py, cifar_net, 32 clients), this took
    the API process from 1.64 to 1.19 million instructions per prediction; a lone request pays a
    `call_soon` and a task more than a direct call (1.85 → 1.87 million at one client).
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._pending: list[_ScriptCall] = []
        self._sending: set[asyncio.Task[None]] = set()  # referenced until done (the loop keeps weak refs)

    async def run(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Any:
        loop = asyncio.get_running_loop()
        call = _ScriptCall(script, keys, args, loop.create_future())
        if not self._pending:
            loop.call_soon(self._flush)  # after the callbacks of this turn: the other requests in it
        self._pending.append(call)
        return await call.result

    def _flush(self) -> None:
        calls, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._send(calls))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, calls: list[_ScriptCall]) -> None:
        calls = [call for call in calls if not call.result.done()]  # a caller that went away queues nothing
        try:
            if calls:
                results = await self._evaluate(calls)
                for call, result in zip(calls, results, strict=True):
                    if call.result.done():  # its caller gave up meanwhile (a cancelled request)
                        continue
                    if isinstance(result, Exception):
                        call.result.set_exception(result)
                    else:
                        call.result.set_result(result)
        except Exception as exc:  # the pipeline itself failed (Redis away): every caller gets the error
            for call in calls:
                if not call.result.done():
                    call.result.set_exception(exc)
        finally:  # cancelled (the loop is closing): nobody is left waiting for ever
            for call in calls:
                if not call.result.done():
                    call.result.cancel()

    async def _evaluate(self, calls: list[_ScriptCall]) -> list[Any]:
        if len(calls) == 1:  # alone in its turn: a plain EVALSHA costs less than a pipeline of one
            try:
                return [await calls[0].script(keys=calls[0].keys, args=calls[0].args)]
            except ResponseError as exc:  # the script's own error, for its caller alone
                return [exc]
        results = await self._pipeline(calls)
        # Redis restarted (or its script cache was flushed): those scripts did not run; load them and
        # run them again (redis-py's own pipeline would ask SCRIPT EXISTS before every pipeline).
        # The others ran: whatever happens to the second try is only the missing calls' answer.
        missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if missing:
            try:
                for script in {calls[i].script.sha: calls[i].script for i in missing}.values():
                    await self.redis.script_load(script.script)
                again: list[Any] = await self._pipeline([calls[i] for i in missing])
            except Exception as exc:
                again = [exc] * len(missing)
            for i, result in zip(missing, again, strict=True):
                results[i] = result
        return results

    async def _pipeline(self, calls: list[_ScriptCall]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for call in calls:
            pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
        return list(await pipe.execute(raise_on_error=False))


@dataclass(frozen=True)
class UploadedImage:
    filename: str | None
    data: bytes


@dataclass(slots=True)
class _InFlight:
    """A queued request while its caller waits: what it takes to send it again."""

    job_id: str | None
    alias: str | None
    images: list[UploadedImage]
    top_k: int
    request_id: str
    deadline: float  # epoch s: kept when the request is sent again
    answer: asyncio.Future[PredictReply]
    holder: tuple[str, str] | None = None  # (device id, worker instance) whose list it went to; None: none yet
    queued_at: float = 0.0  # of its last copy sent: with the rest, it rebuilds that exact message

    def message(self, reply_to: str) -> str:
        """The request as queued (`core/wire.PredictRequest`), also what LREM takes back off the
        holder's list: rebuilt rather than kept, so a request in flight holds its images once, not
        also their base64 copy."""
        assert self.job_id is not None
        return PredictRequest(job_id=self.job_id, top_k=self.top_k, reply_to=reply_to, request_id=self.request_id,
                              queued_at=self.queued_at, deadline=self.deadline,
                              images=[WireImage(filename=i.filename, data=i.data) for i in self.images]).encode()


def check_image(image: UploadedImage, max_bytes: int, max_pixels: int) -> None:
    """Cheap gatekeeping from the header alone; the worker does the full decode."""
    if len(image.data) > max_bytes:
        raise TooLarge(f"{image.filename or 'image'} is {len(image.data)} bytes; the limit is {max_bytes}")
    try:
        with Image.open(io.BytesIO(image.data), formats=IMAGE_FORMATS) as probe:  # no other plugin runs
            fmt, (width, height) = probe.format, probe.size
    except Image.DecompressionBombError as exc:
        raise TooLarge(f"{image.filename or 'image'}: {exc}") from None
    except Exception:
        raise UnsupportedMedia(f"{image.filename or 'file'} is not an image ({IMAGE_FORMATS_TEXT})") from None
    if fmt not in OPENED_FORMATS:
        raise UnsupportedMedia(f"{image.filename or 'file'} is {fmt}; send {IMAGE_FORMATS_TEXT}")
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
        self._instances: dict[str, str] = {}  # live device id → the worker process holding it
        self._live_at = 0.0
        self._in_flight: dict[str, _InFlight] = {}
        self._watcher: asyncio.Task[None] | None = None
        self.on_orphaned: Callable[[float], None] = lambda count: None  # the app counts them (/metrics)
        self._live_reading: asyncio.Future[list[Device]] | None = None
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

    async def predict(self, job_id: str | None, images: list[UploadedImage], top_k: int, *,
                      alias: str | None = None) -> bytes:
        """The JSON body of a PredictResponse, as the worker wrote it (plus `alias` when one was named)."""
        if (job_id is None) == (alias is None):
            raise InvalidInput("send exactly one of job_id and alias")
        if not images:
            raise InvalidInput("send at least one image as a `file` part")
        if len(images) > self.max_images:
            raise TooLarge(f"{len(images)} images in one request; the limit is {self.max_images}")
        if not 1 <= top_k <= 1000:
            raise InvalidInput("top_k must be between 1 and 1000")
        if alias is not None:
            validate_alias_name(alias)
        else:
            validate_id(job_id or "", "job_id")
        for image in images:
            check_image(image, self.max_bytes, self.max_pixels)
        request_id, answer = self.inbox.expect(self.timeout_s)
        flight = _InFlight(job_id, alias, images, top_k, request_id, time.time() + self.timeout_s, answer)
        try:
            await self._send(flight)
            self._in_flight[request_id] = flight
            if self._watcher is None or self._watcher.done():
                self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="torchyard-predict-watch")
            try:
                reply = await answer
            except TimeoutError:
                self._live_at = 0.0  # look again next time: this worker may be gone
                if flight.holder is None:  # its worker went away, and no other came back in time
                    raise Unavailable(f"no worker was alive to take the request again within {self.timeout_s:g}s "
                                      f"(its worker went away)") from None
                raise Unavailable(f"the worker of {flight.holder[0]} did not answer within {self.timeout_s:g}s") from None
        finally:
            self._in_flight.pop(request_id, None)
            self.inbox.forget(request_id, answer)
        reply.raise_for_status()
        return reply.body.encode() if alias is None else _naming_alias(reply.body, alias)

    async def _send(self, flight: _InFlight) -> None:
        """Queue `flight` on a live worker (its alias resolved anew); 404, 409 or 503 when it cannot be."""
        for _ in range(ALIAS_RESOLVE_TRIES):
            if flight.alias is not None:
                flight.job_id = await self._resolve(flight.alias)
            assert flight.job_id is not None
            status = await self._queue(flight)
            if status != _MOVED:
                break
        else:
            raise Unavailable(f"alias {flight.alias} moved {ALIAS_RESOLVE_TRIES} times while this request was "
                              f"queued; retry")
        self._check_status(flight.job_id, status)

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
        live = await self._live_devices()
        gone: dict[str, int] = {}
        for flight in flights:
            if flight.holder is not None and self._instances.get(flight.holder[0]) == flight.holder[1]:
                continue  # its worker is alive: it is computing it, or will
            if flight.holder is not None:
                device_id = flight.holder[0]
                # Not taken yet: no process computes it later. Taken: it died with its worker.
                await self.redis.lrem(keys.predict_queue(device_id), 1, flight.message(self.inbox.key))
                flight.holder = None
                gone[device_id] = gone.get(device_id, 0) + 1
            if not live or flight.answer.done() or time.time() >= flight.deadline:
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
                await self.redis.lrem(keys.predict_queue(flight.holder[0]), 1, flight.message(self.inbox.key))
        for device_id, count in gone.items():
            self.on_orphaned(count)
            log.warning("%d prediction request(s) held by the worker of %s, whose process is gone, sent again",
                        count, device_id)

    async def _resolve(self, alias: str) -> str:
        job_id = await self.redis.hget(keys.ALIASES, alias)
        if job_id is None:
            raise NotFound(f"alias {alias} not found")
        return job_id

    async def _queue(self, flight: _InFlight) -> str | None:
        """Queue the request on a live device if the job succeeded (and the alias still names it):
        the job's status or _MOVED. Records where it went in `flight`."""
        job_id = flight.job_id
        assert job_id is not None
        live = await self._live_devices()
        if not live:  # still say 404 / 409 first: they do not depend on a worker
            self._check_status(job_id, await self.redis.hget(keys.job(job_id), "status"))
            raise NoLiveWorker("no live worker can serve predictions; start one with `torchyard worker`")
        device = self._pick_device(job_id, live)
        flight.queued_at = time.time()
        encoded = flight.message(self.inbox.key)
        if flight.alias is None:
            status = await self._scripts.run(self._queue_if_succeeded, [keys.job(job_id), keys.predict_queue(device.id)],
                                             [JobStatus.succeeded.value, encoded])
        else:
            status = await self._scripts.run(self._queue_if_alias_still_there,
                                             [keys.ALIASES, keys.job(job_id), keys.predict_queue(device.id)],
                                             [flight.alias, job_id, JobStatus.succeeded.value, encoded])
        if status == JobStatus.succeeded.value:
            flight.holder = (device.id, self._instances.get(device.id, ""))
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

    async def _live_devices(self) -> list[Device]:
        if time.monotonic() - self._live_at < LIVE_CACHE_S:
            return self._live
        # One read for every request that finds the cache stale (a burst would otherwise send one
        # each); shielded, so that a caller that goes away does not cancel it for the others.
        if self._live_reading is None or self._live_reading.done():
            self._live_reading = asyncio.ensure_future(self._read_live_devices())
        return await asyncio.shield(self._live_reading)

    async def _read_live_devices(self) -> list[Device]:
        # Bounded: every request in the process waits on this one read, and a connection that
        # hangs (half-open, no socket timeout reached) must not hold them all; the next one reads anew.
        live: list[Device] = []
        instances: dict[str, str] = {}
        async with asyncio.timeout(min(self.timeout_s, LIVE_READ_TIMEOUT_S)):
            ids = sorted(await self.redis.smembers(keys.DEVICES_INDEX))
            if ids:
                pipe = self.redis.pipeline(transaction=False)
                liveness_reads(pipe, ids)
                replies = await pipe.execute()
                live = [d for d in devices_from_replies(replies) if d.status in SERVING]
                instances = alive_instances(ids, replies)
        self._live, self._live_at = live, time.monotonic()
        self._instances = {d.id: instances[d.id] for d in live if d.id in instances}
        return live


def _naming_alias(body: str, alias: str) -> bytes:
    """The worker's PredictResponse with the alias the request named (the worker knows only the job)."""
    doc = orjson.loads(body)
    doc["alias"] = alias
    return strict_json(doc)
