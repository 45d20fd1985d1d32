"""How many bytes of /predict bodies one API process holds at once: admission by bytes in flight.

A /predict request's images stay in the API process from the first byte received until its answer
(they are what is sent again if its worker dies), and each request is capped
(TORCHYARD_MAX_PREDICT_REQUEST_BYTES). Without a bound on their sum, a few concurrent requests of
large images could grow an API process by gigabytes. Each request reserves its bytes as they
arrive (all of a declared Content-Length at once, before a byte is read); a reservation that
would take the process past TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES is refused with a 503 and
`Retry-After`, and the request's bytes are given back when it ends, however it ends.
"""

from __future__ import annotations

from core.errors import Unavailable

RETRY_AFTER_S = 1


class BodyBudget:
    """The process's budget; one event loop uses it, so no lock."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.held = 0

    def reservation(self) -> Reservation:
        return Reservation(self)


class Reservation:
    """One request's share of the budget; `release` gives all of it back (idempotent)."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0

    def reserve(self, n: int) -> None:
        budget = self.budget
        if budget.held + n > budget.limit:
            raise Unavailable(f"this API process holds {budget.held} bytes of images in flight, and this request "
                              f"would take it past its budget of {budget.limit} "
                              f"(TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES); retry shortly",
                              retry_after_s=RETRY_AFTER_S)
        budget.held += n
        self.bytes += n

    def reserve_up_to(self, total: int) -> None:
        """Reserve so that this request holds at least `total` bytes (a declared length, then chunks)."""
        if total > self.bytes:
            self.reserve(total - self.bytes)

    def release(self) -> None:
        self.budget.held -= self.bytes
        self.bytes = 0
