"""Lua scripts of concurrent callers, sent to Redis together (the /predict hot path's queueing)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from core.redis import execute_once


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
