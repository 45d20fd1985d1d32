"""The quotas a job's start is held for: `running_jobs`, `devices_held` (a gang counts its ranks)
and `device_seconds_per_day` (UTC day). Past one of them a job is neither refused nor failed: it
stays `queued`, and its start waits until its project has room.

Why at the claim, and in the claim's own transaction: the worker that took the message is the
only place that knows a job is about to hold a device, and a check made before the write (like
queued_jobs') lets two workers both pass. So core/jobs/delivery.claim WATCHes the running index,
the project's quota and its day's tally, and reads the project's usage from the running jobs'
records inside the transaction: a concurrent claim or end changes the running index, the
transaction retries, and no two claims both take the last place. The usage is read from the
records themselves, so there is no counter to drift or to release: a job that ends, is requeued,
or whose lease expires (its worker was SIGKILLed) leaves the running index and gives its place
back in the same transaction that moves it.

A held claim consumes its message, drops the job's dispatch intent (so the reconciler does not
re-send it, warn, or count a recovery) and parks the job in ty:quota:held with the reason in its
`message`. core/jobs/recovery.release_held re-sends parked jobs whose project has room again: a
worker calls it right after a job of its ends, and the sweep every beat (a lease that expired, a
new UTC day, a quota an admin raised).

Device-seconds: a running job's devices times its seconds since it started running (or since
the UTC day began), plus what the project's jobs that ended today accrued (ty:project:<p>:
device_seconds:<day>, added when a job leaves `running`). A job that runs past the quota is not
stopped: the quota holds new starts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from core import keys
from core.access.projects import project_of

DAY_S = 86_400
HELD_PREFIX = "waiting: project "  # how a held job's message begins (core/gangs/policy.waiting_note keeps it)
HELD_FIELDS = ("running_jobs", "devices_held", "device_seconds_per_day")


def utc_day(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def day_start(now: float) -> float:
    return now - now % DAY_S


def seconds_to_next_day(now: float) -> int:
    return max(1, int(DAY_S - now % DAY_S) + 1)


def devices_of(raw: Mapping[str, Any]) -> int:
    """How many devices a job holds while it runs: a gang's ranks (its params' world_size), else 1."""
    try:
        return max(1, int(json.loads(raw.get("params") or "{}").get("world_size") or 1))
    except (TypeError, ValueError, AttributeError):
        return 1


def accrued_now(raw: Mapping[str, Any], now: float) -> float:
    """The device-seconds a running job accrued today: its devices times its time running since
    it started (this delivery) or since the UTC day began, whichever is later."""
    since = float(raw.get("running_since") or now)
    return devices_of(raw) * max(0.0, now - max(since, day_start(now)))


def read_limits(client: Any, project: str) -> dict[str, int]:
    """The project's hold quotas that are set (none set: an empty dict, and no hold at all)."""
    raw = client.get(keys.project_quota(project))
    quota = json.loads(raw) if raw else {}
    return {field: int(quota[field]) for field in HELD_FIELDS if quota.get(field) is not None}


def usage(client: Any, project: str, now: float) -> dict[str, float]:
    """What the project holds now: its running jobs, their devices, and today's device-seconds."""
    running = client.zrange(keys.jobs_with_status("running"), 0, -1)
    pipe = client.pipeline(transaction=False)
    for job_id in running:
        pipe.hmget(keys.job(job_id), "project", "params", "running_since")
    mine = [{"params": params, "running_since": since} for p, params, since in pipe.execute()
            if project_of(p) == project]
    ended = float(client.get(keys.project_device_seconds(project, utc_day(now))) or 0)
    return {"running_jobs": len(mine), "devices_held": sum(devices_of(r) for r in mine),
            "device_seconds_per_day": ended + sum(accrued_now(r, now) for r in mine)}


def hold_reason(limits: Mapping[str, int], used: Mapping[str, float], project: str, devices: int,
                now: float) -> str | None:
    """Why a job of `devices` devices may not start now, or None when the project has room."""
    if "running_jobs" in limits and used["running_jobs"] + 1 > limits["running_jobs"]:
        return (f"{HELD_PREFIX}{project!r} is at its quota of running_jobs = {limits['running_jobs']}; "
                "it starts when one of its jobs ends")
    if "devices_held" in limits and used["devices_held"] + devices > limits["devices_held"]:
        return (f"{HELD_PREFIX}{project!r} is at its quota of devices_held = {limits['devices_held']} "
                f"({int(used['devices_held'])} held, this job needs {devices}); it starts when its jobs free them")
    if "device_seconds_per_day" in limits and used["device_seconds_per_day"] >= limits["device_seconds_per_day"]:
        return (f"{HELD_PREFIX}{project!r} used its quota of device_seconds_per_day = "
                f"{limits['device_seconds_per_day']} for {utc_day(now)} (UTC); it starts in "
                f"{seconds_to_next_day(now)} s, when the next UTC day begins")
    return None


def accrue_on_end(pipe: Any, raw: Mapping[str, Any], now: float) -> None:
    """Add a job that leaves `running` to its project's tally of today (queued on `pipe`'s MULTI)."""
    spent = accrued_now(raw, now)
    if spent <= 0:
        return
    key = keys.project_device_seconds(project_of(raw.get("project")), utc_day(now))
    pipe.incrbyfloat(key, spent)
    pipe.expire(key, 2 * DAY_S)
