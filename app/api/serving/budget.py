"""The intake's budget: how many bytes of /predict bodies one API process holds at once (admission by
bytes in flight).

A /predict request's images stay in the API process from the first byte received until its answer
(they are what is sent again if its worker dies), and each request is capped
(TORCHYARD_MAX_PREDICT_REQUEST_BYTES). Without a bound on their sum, a few concurrent requests of
large images could grow an API process by gigabytes. Each request reserves its bytes as they
arrive; a reservation that would take the process past TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES, or
one client address past TORCHYARD_PREDICT_MEMORY_PER_CLIENT_BYTES, is refused with a 503 and
`Retry-After`, and the request's bytes are given back when it ends, however it ends.

Why as they arrive and not a declared Content-Length at once: a client that declares 128 MiB and
sends nothing would hold that much of the budget for as long as the body deadline lets it wait,
and four such connections refused every other /predict. Bytes that arrived are bytes the process
holds; bytes announced are not. Why a cap per client address: a body trickled at the minimum rate
(TORCHYARD_MIN_BODY_RATE) holds what it sent for hours; with the cap, one address cannot keep the
others out, whatever it sends (many addresses can: docs/security.md, "Not covered").
"""

from __future__ import annotations

from core.errors import Unavailable

RETRY_AFTER_S = 1


class BodyBudget:
    """The process's budget, and each client address's share of it; one event loop uses it, so no lock."""

    def __init__(self, limit_bytes: int, per_client_bytes: int) -> None:
        self.limit = limit_bytes
        self.per_client = per_client_bytes or limit_bytes  # 0: no cap per address
        self.held = 0
        self.by_client: dict[str, int] = {}  # only addresses that hold bytes now

    def reservation(self, client: str) -> Reservation:
        return Reservation(self, client)


class Reservation:
    """One request's share of the budget; `release` gives all of it back (idempotent)."""

    def __init__(self, budget: BodyBudget, client: str) -> None:
        self.budget = budget
        self.client = client
        self.bytes = 0

    def reserve(self, n: int) -> None:
        budget = self.budget
        if budget.held + n > budget.limit:
            raise Unavailable(f"this API process holds {budget.held} bytes of images in flight, and this request "
                              f"would take it past its budget of {budget.limit} "
                              f"(TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES); retry shortly",
                              retry_after_s=RETRY_AFTER_S)
        mine = budget.by_client.get(self.client, 0)
        if mine + n > budget.per_client:
            raise Unavailable(f"your requests hold {mine} bytes of images in this API process, and this one would "
                              f"take them past the share of one client, {budget.per_client} bytes "
                              f"(TORCHYARD_PREDICT_MEMORY_PER_CLIENT_BYTES); retry once they are answered",
                              retry_after_s=RETRY_AFTER_S)
        budget.held += n
        budget.by_client[self.client] = mine + n
        self.bytes += n

    def release(self) -> None:
        if not self.bytes:
            return
        budget = self.budget
        budget.held -= self.bytes
        left = budget.by_client.get(self.client, 0) - self.bytes
        if left > 0:
            budget.by_client[self.client] = left
        else:
            budget.by_client.pop(self.client, None)
        self.bytes = 0
