"""One rank of a data-parallel job's attempt: what its training gets, how it waits for the other
ranks, and how each side reports an epoch.

`Rank` is what a rank's training (worker/gang/training.py) is handed by its member
(worker/gang/member.py): the seat, the gang's members, the stop check, and on rank 0 the job's
fenced writes and the rendezvous store it opens. Rank 0 reports through the job's delivery and
then records the epoch in the gang record (`LeaderReporter`); another rank writes nothing and waits
after each epoch until rank 0 recorded it (`FollowerReporter`), so rank 0's checkpoint writes never
count against the collectives' timeout. An attempt that breaks because of another rank is
`GangBroken`; what rank 0 makes of it (`Rank.fault`: a stop it must obey, a job failure a rank
reported, or a requeue named `gang_fault: <why>`) the job runner turns into the job's end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import keys
from core.devices import slot_states
from core.gangs import GangRecords, GangState, Member, Seat
from core.gangs.policy import POLL_S, READY_TIMEOUT_S, REASON_GRACE_S
from core.schemas import EpochMetrics, JobStatus, Progress
from worker.gang.collectives import RendezvousServer
from worker.gang.runner import Runner
from worker.runtime.job_context import JobContext, JobFailed, JobReporter, StopJob
from worker.runtime.outages import ride_out_outage

# Prefix of the StopJob reason that makes the runner give the job back (worker/runtime/job_runner.py).
GANG_FAULT = "gang_fault"


class GangBroken(Exception):
    """The attempt is over because of another rank (or the gang record says so)."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


@dataclass
class Rank:
    """What one rank's training gets (worker/gang/training.py)."""

    runner: Runner
    records: GangRecords
    job_id: str
    token: str
    seat: Seat
    members: list[Member]
    should_stop: Callable[[], str | None]
    ctx: JobContext | None = None  # rank 0's: the job's fenced writes; None for the others
    address: str | None = None  # rank 0's rendezvous store, "<host>:<port>"
    secret: str | None = field(default=None, repr=False)  # the attempt's namespace in that store
    rendezvous: RendezvousServer | None = field(default=None, repr=False)  # rank 0's store, while it runs

    @property
    def leader(self) -> bool:
        return self.seat.rank == 0

    @property
    def world_size(self) -> int:
        return len(self.members)

    def read(self) -> GangState | None:
        """The gang record, through a Redis outage (the collectives' timeout may end the attempt meanwhile)."""
        halted = self.runner.state.shutdown.is_set
        return ride_out_outage(lambda: self.records.read(self.job_id), halted=halted, what=f"job {self.job_id}")

    def wait_ready(self, ranks: set[int]) -> GangState:
        """Until `ranks` are ready. Ends the attempt (GangBroken, StopJob) when it vanished, a rank
        reported a failure, a rank's worker stopped beating or freed its device, or this rank must stop."""
        started = time.monotonic()
        devices = [m.device for m in self.members]
        while True:
            gang = self.read()
            if gang is None or gang.attempt != self.seat.attempt:
                raise GangBroken("the gang's attempt ended before training started")
            if gang.failure:
                raise GangBroken(gang.failure, gang.fatal)
            if (reason := self.should_stop()) is not None:
                raise StopJob(reason)
            if ranks <= gang.ready:
                return gang
            dead = [device for device, alive in zip(devices, self.records.alive(devices), strict=True) if not alive]
            slots = slot_states(self.records.redis, devices)
            left = [device for device in devices if slots.get(device, ("", ""))[1] != self.job_id]
            if dead or left:
                raise GangBroken(f"the worker of {', '.join(dead or left)} left before training started")
            if time.monotonic() - started > READY_TIMEOUT_S:
                raise GangBroken(f"ranks {sorted(ranks - gang.ready)} were not ready after {READY_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)

    def fault(self, exc: BaseException) -> BaseException:
        """What rank 0 raises once the attempt broke: the stop it must obey (cancelled, lost lease),
        a job failure a rank reported, or a requeue naming the reason."""
        reason = self.should_stop()  # this worker's own flags, the job's status, token and cancel flag
        if reason is not None:
            return StopJob(reason)
        if isinstance(exc, GangBroken):
            return JobFailed(str(exc)) if exc.fatal else StopJob(f"{GANG_FAULT}: {exc}")
        deadline = time.monotonic() + REASON_GRACE_S
        while True:  # the peer that left may record why a moment after its sockets closed
            gang = self.read()
            if gang is not None and gang.failure:
                return JobFailed(gang.failure) if gang.fatal else StopJob(f"{GANG_FAULT}: {gang.failure}")
            if time.monotonic() > deadline:
                return StopJob(f"{GANG_FAULT}: a rank left the gang ({str(exc)[:300]})")
            time.sleep(POLL_S)


class LeaderReporter:
    """Rank 0 reports through the job's delivery, then lets the other ranks past the recorded epoch."""

    def __init__(self, inner: JobReporter, rank: Rank) -> None:
        self.inner, self.rank = inner, rank

    def progress(self, progress: Progress) -> None:
        self.inner.progress(progress)

    def resumed(self, epoch: int) -> None:
        self.inner.resumed(epoch)

    def notice(self, kind: str, data: dict[str, Any], message: str) -> None:
        self.inner.notice(kind, data, message)

    def epoch(self, metrics: EpochMetrics, resume: Path | None = None) -> None:
        self.inner.epoch(metrics, resume)
        rank = self.rank
        assert rank.ctx is not None
        rank.ctx.delivery.call(rank.records.record_epoch, rank.job_id, rank.seat.attempt, metrics.epoch)


class FollowerReporter:
    """Another rank writes nothing; after each epoch it waits until rank 0 recorded it (so rank 0's
    checkpoint writes never count against the collectives' timeout)."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank

    def progress(self, progress: Progress) -> None:
        pass

    def resumed(self, epoch: int) -> None:
        pass

    def notice(self, kind: str, data: dict[str, Any], message: str) -> None:
        pass

    def epoch(self, metrics: EpochMetrics, resume: Path | None = None) -> None:
        rank = self.rank
        while True:
            gang = rank.read()
            if gang is not None and gang.attempt == rank.seat.attempt:
                if gang.failure:
                    raise GangBroken(gang.failure, gang.fatal)
                if gang.epoch >= metrics.epoch:
                    return
            else:
                status, delivery = rank.runner.store.redis.hmget(keys.job(rank.job_id), "status", "delivery")
                if status == JobStatus.succeeded.value and delivery == rank.token:
                    return  # rank 0 recorded it and finished the job already
                raise StopJob("lease_lost")
            if (reason := rank.should_stop()) is not None:
                raise StopJob(reason)
            time.sleep(POLL_S)
