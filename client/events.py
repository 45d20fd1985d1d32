"""A job's event stream as the client sees it: the events, their parsing, and how a follower
waits out an API restart or a Redis outage (client/sdk.py `TorchyardClient.events`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from httpx_sse import ServerSentEvent

from core.schemas import JobStatus

# A follower waits through these answers (a proxy in front of a restarting API, or the API without
# its Redis) and through refused connections; every other error is final.
RETRIABLE_STATUSES = frozenset({502, 503, 504})
RECONNECT_MAX_S = 5.0


@dataclass(frozen=True)
class Event:
    """One server-sent event of a job: `kind` is status, progress, metrics or cancel_requested."""

    id: str | None
    kind: str
    data: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.kind == "status" and self.data.get("status") in {s.value for s in JobStatus if s.terminal}


def parse_event(sse: ServerSentEvent) -> Event | None:
    """Our Event from httpx-sse's; None for a frame without data (the stream's `retry:` line)."""
    if not sse.data:
        return None
    try:
        parsed = json.loads(sse.data)
    except ValueError:
        parsed = {"raw": sse.data}
    return Event(sse.id or None, sse.event, parsed if isinstance(parsed, dict) else {"value": parsed})


class Waiting:
    """An outage as a follower sees it: told once when it starts and once when it ends; the pause
    before each new try doubles up to RECONNECT_MAX_S."""

    def __init__(self, notify: Callable[[str | None], None] | None) -> None:
        self.notify = notify
        self.waiting = False
        self.tries = 0

    def start(self, reason: str) -> None:
        self.tries += 1
        if not self.waiting and self.notify is not None:
            self.notify(reason)
        self.waiting = True

    def over(self) -> None:
        if self.waiting and self.notify is not None:
            self.notify(None)
        self.waiting = False
        self.tries = 0

    def next_pause(self) -> float:
        """After a failure: 0.2, 0.4, ... up to RECONNECT_MAX_S; after a clean end of the stream, 0.2 s."""
        return min(RECONNECT_MAX_S, 0.2 * 2 ** max(0, self.tries - 1))
