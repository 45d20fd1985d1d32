"""What a worker's threads share: the job in hand, and the flags that stop it.

The training task (Celery's main thread) sets the job and its delivery token (`begin`, `end`),
and whether this worker holds the job's lease (a gang's ranks but rank 0 do not: `leased`);
the heartbeat thread publishes them and reports a refused lease renewal (`lease_lost_by`), which
stops the job only if that token is still the one in hand (a late report about the previous job
must not stop the next); SIGTERM sets `shutdown`; a sticky device error (worker/device/health.py),
seen by either thread, sets `out_of_service`. The training loop reads all of them every step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class WorkerState:
    current_job: str | None = None
    current_token: str | None = None
    leased: bool = True  # the heartbeat renews the job's lease (rank 0 of a gang, or a job of its own)
    shutdown: threading.Event = field(default_factory=threading.Event)
    lease_lost: threading.Event = field(default_factory=threading.Event)
    out_of_service: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, job_id: str, token: str, *, leased: bool = True) -> None:
        with self._lock:
            self.current_job, self.current_token, self.leased = job_id, token, leased
            self.lease_lost.clear()

    def end(self) -> None:
        with self._lock:
            self.current_job = self.current_token = None

    def lease_lost_by(self, token: str) -> None:
        """The job store refused to renew `token`'s lease: stop the job if it is still that delivery."""
        with self._lock:
            if self.current_token == token:
                self.lease_lost.set()
