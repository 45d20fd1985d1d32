"""The transport stage: a request's message onto a device's list in Redis, and off it again.

The worker's transport stage (worker/serving/transport.py) takes what this one queues. A message
is the body's buffer with a core/wire.PredictHeader appended (framed in place by the engine,
app/api/serving/engine.py). One Lua script checks that the job succeeded (and, for a request that
named an alias, that the alias still names that job) and RPUSHes the message to the device's list,
atomically, so a request is answered by the one job it was queued for and an alias's move and the
requests' queueing are ordered by Redis itself. The scripts of the requests that arrive in one
turn of the event loop go to Redis in one pipeline (`CoalescedScripts`), written once without a
copy of the bodies and never retried (core/redis.execute_once), so a request is queued once
however slow the link or late Redis's answer. A message whose worker process is gone is taken
back off its list by the LREM of its exact bytes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from core import keys
from core.redis import execute_once
from core.schemas import JobStatus

# A succeeded job of another kind (an evaluation, an export...) has no model to predict with: the
# scripts answer this prefix, the job's kind and its params (which name the job it was made from).
NOT_A_MODEL = "~not-a-model "
# A job of another project than the request's (ARGV[{project}], '' for any) is no job for it: nil.
_KIND_CHECK = """
local job = redis.call('HMGET', KEYS[{job}], 'status', 'kind', 'params', 'project')
if ARGV[{project}] ~= '' and (job[4] or 'default') ~= ARGV[{project}] then
  return nil
end
local status = job[1]
if status == ARGV[{succeeded}] and job[2] and job[2] ~= 'train' then
  return '""" + NOT_A_MODEL + """' .. job[2] .. ' ' .. (job[3] or '')
end
"""
# Queue the request only if the job succeeded; return its status either way (nil: no such job).
_QUEUE_IF_SUCCEEDED = _KIND_CHECK.format(job=1, succeeded=1, project=3) + """
if status == ARGV[1] then
  redis.call('RPUSH', KEYS[2], ARGV[2])
end
return status
"""
# The same for a request that named an alias: queue it only while the alias still points at the job
# it was resolved to (ARGV[2]); MOVED otherwise, and the caller resolves the name again.
MOVED = "~moved"
_QUEUE_IF_ALIAS_STILL_THERE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return '""" + MOVED + """'
end
""" + _KIND_CHECK.format(job=2, succeeded=3, project=5) + """
if status == ARGV[3] then
  redis.call('RPUSH', KEYS[3], ARGV[4])
end
return status
"""


class Transport:
    """The devices' /predict lists, as the API writes them: queue a message, take it back."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._scripts = CoalescedScripts(client)
        self._queue_if_succeeded = client.register_script(_QUEUE_IF_SUCCEEDED)
        self._queue_if_alias_still_there = client.register_script(_QUEUE_IF_ALIAS_STILL_THERE)

    async def queue(self, device_id: str, job_id: str, message: memoryview | bytes, alias: str | None = None,
                    project: str = "") -> str | None:
        """RPUSH `message` to the device's list if the job succeeded, is of `project` (when one is
        named) and, given `alias` (its stored name), that name still points at the job: the job's
        status either way (None: no such job, or another project's), or MOVED."""
        if alias is None:
            return await self._scripts.run(self._queue_if_succeeded, [keys.job(job_id), keys.predict_queue(device_id)],
                                           [JobStatus.succeeded.value, message, project])
        return await self._scripts.run(self._queue_if_alias_still_there,
                                       [keys.ALIASES, keys.job(job_id), keys.predict_queue(device_id)],
                                       [alias, job_id, JobStatus.succeeded.value, message, project])

    async def take_back(self, device_id: str, message: memoryview | bytes) -> None:
        """Remove `message` from the device's list, if it is still there: an LREM of its exact bytes,
        written without a copy (core/redis.execute_once)."""
        (removed,) = await execute_once(self.redis, [("LREM", keys.predict_queue(device_id), 1, message)])
        if isinstance(removed, Exception):
            raise removed


@dataclass(frozen=True)
class _ScriptCall:
    script: AsyncScript
    keys: list[str]
    args: list[Any]
    result: asyncio.Future[Any]


class CoalescedScripts:
    """Lua scripts of concurrent callers, sent to Redis together: every call made in one turn of
    the event loop goes in one pipeline of EVALSHAs (not a transaction: each script is atomic on
    its own, exactly as when it is sent alone, and answers its own caller, errors included). The
    pipeline is written once and never retried (core/redis.execute_once): its scripts queue the
    requests' bodies, and a retry of a write that had reached Redis would queue them again.

    Why: one command on redis-py's asyncio client costs this process more than the rest of a
    prediction's Redis work (a pooled connection taken and given back, the send and the read each
    under a timeout, its observability hooks), and under load requests arrive in bursts: a batch of
    answers from the worker releases its clients together, and they send their next requests
    together, so one pipeline carries a burst for about the price of one command (counted with
    callgrind by bench/api_instructions.py; docs/benchmarks.md). A lone request pays a `call_soon`
    and a task more than a direct call, and its script goes alone, as a plain EVALSHA.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._pending: list[_ScriptCall] = []
        self._sending: set[asyncio.Task[None]] = set()  # referenced until done (the loop keeps weak refs)
        self._loaded: set[str] = set()  # the scripts this process has loaded (Redis may forget them: NOSCRIPT)

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
        # Loaded before its first use, rather than on a NOSCRIPT: the calls carry requests' bodies,
        # which would otherwise be sent to this Redis twice.
        for script in {call.script.sha: call.script for call in calls if call.script.sha not in self._loaded}.values():
            await self.redis.script_load(script.script)
            self._loaded.add(script.sha)
        results = await self._execute(calls)
        # Redis restarted (or its script cache was flushed): those scripts did not run; load them and
        # run them again (redis-py's own pipeline would ask SCRIPT EXISTS before every pipeline).
        # The others ran: whatever happens to the second try is only the missing calls' answer.
        missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if missing:
            try:
                for script in {calls[i].script.sha: calls[i].script for i in missing}.values():
                    await self.redis.script_load(script.script)
                again: list[Any] = await self._execute([calls[i] for i in missing])
            except Exception as exc:
                again = [exc] * len(missing)
            for i, result in zip(missing, again, strict=True):
                results[i] = result
        return results

    async def _execute(self, calls: list[_ScriptCall]) -> list[Any]:
        """One EVALSHA per call, in one write, never retried (core/redis.execute_once): a script
        queues a request's whole body, which must reach its list once, however long it takes."""
        return await execute_once(self.redis, [("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
                                               for call in calls])
