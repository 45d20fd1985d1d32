"""The API's serving engine: a /predict request's stages on this side of the wire, wired together.

The worker's engine (worker/serving/engine.py) serves what this one sends; the stages, each in its
own module, read in a request's order:

- intake (app/api/serving/intake.py): the body read as it streams (multipart.py), its bytes held
  against the process's budget (budget.py), each image's header checked: a `PredictCall`;
- devices (app/api/serving/devices.py): the live devices, the one the request goes to (its model
  resident first, then an idle one), and Redis's clock;
- transport (app/api/serving/transport.py): the message (the body's own buffer, a
  core/wire.PredictHeader appended) queued on that device's list by one script that checks the job,
  in one pipeline per event-loop turn; taken back by its exact bytes;
- replies (app/api/serving/replies.py): this process's inbox, where the worker's replies stage
  RPUSHes the answers; the waiting request is resolved, the worker's JSON is the HTTP body as is.

The images are never copied, re-encoded or held twice, and a request sent again is the same bytes.
No thread is parked per request: everything here runs on the event loop, over the API's async
Redis client. app/api/serving/direct.py is how the front gate calls `answer`.

A worker that dies holding requests (SIGKILL, OOM, a lost host) does not answer them, and the
ones still on its list would wait for a process that is not coming back: `PredictionClient`
watches the requests in flight against the live devices, and a request whose worker process is
gone is taken back off its list and sent again to a live worker, keeping its id and deadline.
Predictions are pure, so a request that ends up computed twice (its worker was only frozen) costs
time, not correctness: the first answer wins and the other is dropped.

A request may name an alias instead of a job (core/aliases.py): the name is resolved to a job id,
and the script that queues the request first checks that the alias still points there (else the
request is resolved again), so a request is answered by the one job it was queued for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from starlette.requests import Request

from app.api.serving.devices import LiveDevices
from app.api.serving.intake import Intake, PredictCall
from app.api.serving.replies import ReplyInbox
from app.api.serving.transport import MOVED, NOT_A_MODEL, Transport
from core import keys
from core.access.projects import acting, project_of, scoped_name
from core.config import Settings
from core.errors import Conflict, NotFound, TorchyardError, Unavailable
from core.kind_words import job_phrase
from core.schemas import JobKind, JobStatus
from core.wire import PredictReply, PredictRequest, encode_header

log = logging.getLogger(__name__)

# How often the requests in flight are checked against the workers that hold them: a request whose
# worker process is gone is sent again within this (plus the live view's age) of its heartbeat lapsing.
WATCH_S = 1.0
ALIAS_RESOLVE_TRIES = 5


class NoLiveWorker(Unavailable):
    """No worker is alive to take a request: a 503 for a new request, a wait for one sent again."""


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
    # The one project whose jobs it may use ("": any; core/access/projects.py), and its alias's stored
    # name: taken in the request's context, since a resend runs in the watcher's task.
    project: str = ""
    alias_key: str | None = None


class PredictionClient:
    def __init__(self, client: aioredis.Redis, settings: Settings) -> None:
        self.redis = client
        self.timeout_s = settings.predict_timeout_s
        self.intake = Intake(settings)
        self.live = LiveDevices(client, self.timeout_s)
        self.transport = Transport(client)
        self.inbox = ReplyInbox(client)
        self._in_flight: dict[str, _InFlight] = {}
        self._watcher: asyncio.Task[None] | None = None
        self.on_orphaned: Callable[[float], None] = lambda count: None  # the app counts them (/metrics)

    async def close(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await self.inbox.close()

    async def answer(self, request: Request) -> bytes:
        """POST /predict: the JSON body of a PredictResponse, as the worker wrote it."""
        reservation = self.intake.reservation(request)
        try:
            return await self.predict(await self.intake.read(request, reservation))
        finally:
            reservation.release()

    async def predict(self, call: PredictCall) -> bytes:
        request_id, answer = self.inbox.expect(self.timeout_s)
        await self.live.read()  # Redis's clock is known from here on
        flight = _InFlight(call, request_id, self.live.clock.now() + self.timeout_s, answer, len(call.form.buffer),
                           project=acting().sees or "", alias_key=scoped_name(call.alias) if call.alias else None)
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
        header = encode_header(job_id=job_id, alias=call.alias, top_k=call.top_k, reply_to=self.inbox.key,
                               request_id=flight.request_id, queued_at=self.live.clock.now(), deadline=flight.deadline,
                               images=call.form.images, encoding=call.encoding, shape=call.shape, reply=call.reply)
        flight.message, flight.job_id = PredictRequest.frame_in_place(buffer, header), job_id
        return flight.message

    async def _send(self, flight: _InFlight) -> None:
        """Queue `flight` on a live worker (its alias resolved anew); 404, 409 or 503 when it cannot be."""
        alias = flight.call.alias
        for _ in range(ALIAS_RESOLVE_TRIES):
            job_id = await self._resolve(flight) if alias is not None else flight.call.job_id
            assert job_id is not None
            status = await self._queue(flight, job_id)
            if status != MOVED:
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
                await self._take_back(flight)
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
                await self._take_back(flight)
        for device_id, count in gone.items():
            self.on_orphaned(count)
            log.warning("%d prediction request(s) held by the worker of %s, whose process is gone, sent again",
                        count, device_id)

    async def _take_back(self, flight: _InFlight) -> None:
        """The request's message off the list it went to (or may have), if it is still there."""
        assert flight.holder is not None and flight.message is not None
        await self.transport.take_back(flight.holder[0], flight.message)

    async def _resolve(self, flight: _InFlight) -> str:
        job_id = await self.redis.hget(keys.ALIASES, flight.alias_key)
        if job_id is None:
            raise NotFound(f"alias {flight.call.alias} not found")
        return job_id

    async def _queue(self, flight: _InFlight, job_id: str) -> str | None:
        """Queue the request for `job_id` on a live device if the job succeeded (and the alias still
        names it): the job's status or MOVED. Records where it went in `flight`."""
        live = await self.live.read()
        if not live:  # still say 404 / 409 first: they do not depend on a worker
            status, kind, params, project = await self.redis.hmget(keys.job(job_id),
                                                                   ["status", "kind", "params", "project"])
            if flight.project and project_of(project) != flight.project:
                status = None  # another project's job: not there for this request
            if status == JobStatus.succeeded.value and kind not in (None, JobKind.train.value):
                status = f"{NOT_A_MODEL}{kind} {params or ''}"
            self._check_status(job_id, status)
            raise NoLiveWorker("no live worker can serve predictions; start one with `torchyard worker`",
                               retry_after_s=2)
        device = self.live.pick_device(job_id, live)
        message = self._frame(flight, job_id)
        # Where the message may be from here on: should the script's answer be lost (a timeout, a broken
        # connection), it may have run, and the watcher takes it back from there before sending it
        # again, rather than leave a second copy on a list.
        flight.holder = (device.id, self.live.holder(device.id) or "")
        status = await self.transport.queue(device.id, job_id, message, flight.alias_key, flight.project)
        if status != JobStatus.succeeded.value:
            flight.holder = None  # not queued
        return status

    @staticmethod
    def _check_status(job_id: str, status: str | None) -> None:
        if status is None:
            raise NotFound(f"job {job_id} not found")
        if status.startswith(NOT_A_MODEL):
            kind, _, params = status.removeprefix(NOT_A_MODEL).partition(" ")
            raise Conflict(f"job {job_id} is {job_phrase(kind, json.loads(params) if params else None)}, which has "
                           f"no model; predict with a training job's id")
        if status != JobStatus.succeeded.value:
            raise Conflict(f"job {job_id} is {status}; only a succeeded job can predict")
