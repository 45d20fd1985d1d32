"""Redis outages ridden out: a call retried with backoff until Redis answers again.

A job's fenced writes (worker/runtime/delivery.py), its claim (worker/runtime/job_runner.py) and a
gang's slots and records (worker/gang/) all wait out an outage instead of failing: a restart of
the embedded Redis is over within the first few tries, and 60 s outages are tested. Only a worker
that is shutting down stops waiting (`halted`): its lease lapses and another worker resumes the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from core.redis import OUTAGE_ERRORS

log = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds between tries while Redis is away: quick first (a restart is short), then every 2 s.
OUTAGE_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)


def ride_out_outage(call: Callable[[], T], *, halted: Callable[[], bool], what: str) -> T:
    """`call()`, retried through a Redis outage until it answers, unless `halted()` (then the
    outage error is raised). Other errors pass through at once."""
    paused_at: float | None = None
    tries = 0
    while True:
        try:
            result = call()
        except OUTAGE_ERRORS as exc:
            if halted():
                raise
            if paused_at is None:
                paused_at = time.monotonic()
                log.warning("%s paused: Redis is unavailable (%s: %s); retrying", what, type(exc).__name__, exc)
            time.sleep(OUTAGE_BACKOFF_S[min(tries, len(OUTAGE_BACKOFF_S) - 1)])
            tries += 1
            continue
        if paused_at is not None:
            log.warning("%s goes on: Redis answered again after %.1f s", what, time.monotonic() - paused_at)
        return result
