"""`JobStore`: the job store as the API and the workers hold it, one object made of the package's
parts (core/jobs/__init__.py has the map). Each part is a mixin over `records.JobStoreBase`, so
they share one connection, one set of settings and the helpers that write a transition, and a
caller holds one store whichever parts it uses."""

from __future__ import annotations

from core.jobs.delivery import DeliverySide
from core.jobs.intake import Intake
from core.jobs.listing import Listing
from core.jobs.recovery import Recovery


class JobStore(Intake, Listing, DeliverySide, Recovery):
    """Job records in Redis. Synchronous: shared by the API (thread pool) and the workers."""
