"""How every torchyard process logs: one format, and a Redis outage told once, not per retry.

Every process (`up`, `api` and each of its children, `worker`, the client commands) calls
`configure_logging` once when it starts. A Redis outage is expected (a restart of the embedded
Redis, a `docker compose restart redis`): the components that ride it out retry every fraction
of a second, and each retry used to log a full traceback, one for every retry of the outage.
Here:

- `RedisOutageLog` is what a component that watches Redis uses to say, once, that Redis went
  away and, once, that it answers again (the worker's heartbeat, the API's reply listener, a
  paused job);
- `OutageFilter`, on the handlers, turns any other record that carries a Redis outage error (as
  its exception or one of its arguments) into a single line without its traceback, and holds back
  that logger's repeats until the outage is over (an `answered` line, or a quiet minute).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from core.redis import OUTAGE_ERRORS

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# A logger that has said nothing about an outage for this long starts afresh: its next outage
# record is a new outage's first line.
OUTAGE_QUIET_S = 60.0
# Set on the records of RedisOutageLog: the start and end lines, which the filter always lets through.
OUTAGE_MARK = "redis_outage"


def configure_logging(level: int = logging.INFO) -> None:
    """The process's logging: LOG_FORMAT to stderr, outage records collapsed (see the module)."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    outage_filter = OutageFilter()
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, OutageFilter) for f in handler.filters):
            handler.addFilter(outage_filter)


def is_outage_error(value: object) -> bool:
    return isinstance(value, OUTAGE_ERRORS)


class OutageFilter(logging.Filter):
    """One line per logger per Redis outage, without a traceback (see the module docstring)."""

    def __init__(self, quiet_s: float = OUTAGE_QUIET_S) -> None:
        super().__init__()
        self.quiet_s = quiet_s
        self._last_said: dict[str, float] = {}  # logger name -> when it last logged about the outage
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        mark = getattr(record, OUTAGE_MARK, None)
        if mark == "answered":
            with self._lock:
                self._last_said.clear()  # the outage is over: the next one is told afresh
            return True
        if mark is not None or not _carries_outage_error(record):
            return True
        record.exc_info = None  # an expected outage: what failed is in the message, not a traceback
        record.exc_text = None
        now = time.monotonic()
        with self._lock:
            last = self._last_said.get(record.name)
            self._last_said[record.name] = now
        return last is None or now - last > self.quiet_s


def _carries_outage_error(record: logging.LogRecord) -> bool:
    if record.exc_info and is_outage_error(record.exc_info[1]):
        return True
    args: Any = record.args
    values = args.values() if isinstance(args, dict) else args if isinstance(args, tuple) else ()
    return any(is_outage_error(value) for value in values)


class RedisOutageLog:
    """What one component says about a Redis outage: a line when it first fails, a line when
    Redis answers again (with how long it was away), nothing in between. Thread-safe."""

    def __init__(self, logger: logging.Logger, component: str) -> None:
        self.log = logger
        self.component = component
        self._since: float | None = None
        self._lock = threading.Lock()

    @property
    def ongoing(self) -> bool:
        return self._since is not None

    def unavailable(self, exc: BaseException) -> None:
        with self._lock:
            if self._since is not None:
                return
            self._since = time.monotonic()
        self.log.warning("%s: Redis is unavailable (%s: %s); retrying until it answers", self.component,
                         type(exc).__name__, exc, extra={OUTAGE_MARK: "unavailable"})

    def answered(self) -> None:
        if self._since is None:  # the common case, without the lock: called after every success
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            self.log.warning("%s: Redis answers again, after %.1f s", self.component, time.monotonic() - since,
                             extra={OUTAGE_MARK: "answered"})
