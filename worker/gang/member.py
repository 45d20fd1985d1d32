"""One worker's part in a data-parallel job: a rank, from its message to leaving the gang.

The gang scheduler (core/gangs/scheduler.py) reserved this device's slot for one rank of one
attempt and sent `torchyard.train(job, token, seat)` to this device's queue. The task:

1. **Joins**: takes the slot reserved for exactly that seat (a message of a lapsed or replaced
   attempt finds nothing and runs nothing).
2. **Rank 0** claims the job like any delivery (JobStore.claim: `running`, an attempt counted, a
   lease only it renews) and runs the training handler with the job's fenced delivery: it opens
   the rendezvous store on this worker's advertised address and starts the gang record with that
   address and the attempt's secret (worker/gang/training.py). **Other ranks** wait until the
   record says the gang runs (or the attempt vanishes), then run the same handler without any way
   to write the job.
3. Every rank loads its data and plan, marks itself ready and waits for all ranks (polling Redis:
   a rank whose worker's heartbeat lapses meanwhile, or that reports a failure, ends the attempt),
   then joins the process group and trains.
4. When it ends, rank 0's outcome takes the runner's usual paths (finished, failed, cancelled,
   requeued); a peer that died, froze past the process group's timeout or left is a requeue
   (`gang_fault: <why>`), one per attempt since only rank 0 writes. Another rank that fails
   records why in the gang record (for rank 0's message) and leaves; it never writes the job.
5. The slot is freed; rank 0 ends the gang record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from core.devices import DeviceSlots
from core.gangs import GangRecords, GangState, Member, Seat
from core.gangs.policy import POLL_S, REFUSED_PAUSE_S
from core.redis import OUTAGE_ERRORS
from core.schemas import Job
from worker.data.datasets import DatasetUnavailable
from worker.device.cpu_threads import run_in_own_thread
from worker.gang.collectives import is_collective_failure
from worker.gang.rank import GangBroken, Rank
from worker.gang.runner import Runner
from worker.gang.training import run_gang_training
from worker.runtime.job_context import JobContext, JobFailed, StopJob
from worker.runtime.outages import ride_out_outage
from worker.training.trainer import NonFiniteLoss

log = logging.getLogger(__name__)

# Failures a rank reports that end the job (they would recur on any devices); others requeue it.
FATAL = (JobFailed, NonFiniteLoss)


class GangServices(NamedTuple):
    """What a worker's runner needs of Redis for gangs (worker/runtime/main.py builds it)."""

    slots: DeviceSlots
    records: GangRecords
    resend: Callable[[str, str], None]  # a refused single-device job's message, back to its queue


class GangMember:
    """A JobRunner's gang side: the device slot around every task, and the tasks that are ranks."""

    def __init__(self, runner: Runner, slots: DeviceSlots, records: GangRecords,
                 resend: Callable[[str, str], None]) -> None:
        self.runner, self.slots, self.records, self.resend = runner, slots, records, resend
        self._refused = ""  # the last single-device job given back (logged once, not at every turn)

    def take_device(self, job_id: str, token: str) -> bool:
        """Before a single-device job: False when the slot is reserved for a gang's rank (the job's
        message goes back to its queue, for another worker or for this one after its rank)."""
        halted = self.runner.state.shutdown.is_set
        if ride_out_outage(lambda: self.slots.take_for_job(job_id, token), halted=halted, what=f"job {job_id}"):
            return True
        (log.info if job_id != self._refused else log.debug)(
            "job %s not started: %s is reserved or held for a gang; its message goes back to its queue", job_id,
            self.runner.device.id)
        self._refused = job_id
        ride_out_outage(lambda: self.resend(job_id, token), halted=halted, what=f"job {job_id}")
        # Not straight back to the consumer: it would take the same message again at once (until the
        # gang starts); meanwhile another worker may take it, and this one its rank's message next.
        time.sleep(REFUSED_PAUSE_S)
        return False

    def release_device(self, job_id: str, token: str, attempt: str = "") -> None:
        try:
            ride_out_outage(lambda: self.slots.release(job_id, token, attempt), halted=self.runner.state.shutdown.is_set,
                            what=f"job {job_id}")
        except OUTAGE_ERRORS:
            log.warning("job %s: could not free %s's slot (Redis away while shutting down)", job_id,
                        self.runner.device.id)

    def run(self, job_id: str, token: str, raw_seat: str) -> None:
        runner = self.runner
        seat = Seat.parse(raw_seat)
        halted = runner.state.shutdown.is_set
        if runner.state.out_of_service.is_set() or halted():
            return  # the reservation lapses; the scheduler places the job again
        if not ride_out_outage(lambda: self.slots.join(job_id, token, seat), halted=halted, what=f"job {job_id}"):
            log.info("job %s: rank %d's message belongs to an attempt that is over; nothing to do", job_id, seat.rank)
            return
        try:
            gang = self.records.read(job_id)
            if gang is None or gang.attempt != seat.attempt:
                return
            if seat.rank == 0:
                self._lead(job_id, token, seat, gang.members)
            else:
                self._follow(job_id, token, seat, gang.members)
        finally:
            self.release_device(job_id, token, seat.attempt)

    def _lead(self, job_id: str, token: str, seat: Seat, members: list[Member]) -> None:
        def handler(job: Job, ctx: JobContext) -> Any:
            rank = Rank(self.runner, self.records, job_id, token, seat, members, ctx.should_stop, ctx=ctx)
            return run_gang_training(job, rank)

        try:
            self.runner.run_delivery(job_id, token, handler)
        finally:
            self.records.end(job_id, seat.attempt)

    def _follow(self, job_id: str, token: str, seat: Seat, members: list[Member]) -> None:
        runner = self.runner
        gang = self._await_start(job_id, seat)
        if gang is None:
            log.info("job %s: rank %d leaves: its attempt ended before rank 0 started it", job_id, seat.rank)
            return
        rank = Rank(runner, self.records, job_id, token, seat, members, lambda: self._follower_stop(job_id, token),
                    address=gang.address, secret=gang.secret)
        runner.state.begin(job_id, token, leased=False)
        try:
            job = runner.store.get(job_id)
            runner.release_cores()
            run_in_own_thread(lambda: run_gang_training(job, rank), runner.torch_threads, f"torchyard-rank-{job_id}")
        except StopJob as stop:
            log.info("job %s: rank %d stops (%s)", job_id, seat.rank, stop.reason)
            if stop.reason in ("shutdown", "device_broken"):  # rank 0 gives the job back saying why
                self.records.fail(job_id, seat, runner.device.id, f"its worker stopped ({stop.reason})")
        except GangBroken as exc:
            log.warning("job %s: rank %d leaves: %s", job_id, seat.rank, exc)
        except Exception as exc:
            self._follower_failed(job_id, seat, exc)
        finally:
            runner.state.end()

    def _follower_failed(self, job_id: str, seat: Seat, exc: Exception) -> None:
        runner = self.runner
        if is_collective_failure(exc):
            log.warning("job %s: rank %d leaves: the gang broke (%s)", job_id, seat.rank, str(exc)[:300])
            return
        broken = runner.health.job_failed(exc)
        if not isinstance(exc, (*FATAL, DatasetUnavailable)):
            log.error("job %s: rank %d failed", job_id, seat.rank, exc_info=exc)
        message = f"device went out of service ({broken})" if broken else f"{type(exc).__name__}: {exc}"
        fatal = isinstance(exc, FATAL) and not broken
        try:
            self.records.fail(job_id, seat, runner.device.id, str(exc) if fatal else message, fatal=fatal)
        except OUTAGE_ERRORS:
            log.warning("job %s: rank %d could not record why it left (Redis away)", job_id, seat.rank)
        if broken:
            runner.state.out_of_service.set()
            runner.take_out_of_service(broken)

    def _await_start(self, job_id: str, seat: Seat) -> GangState | None:
        """Until rank 0 claimed the job and published its store (None: the attempt is over)."""
        limit = time.monotonic() + max(60.0, 3 * self.runner.settings.lease_ttl_s)
        state = self.runner.state
        while not (state.shutdown.is_set() or state.out_of_service.is_set()) and time.monotonic() < limit:
            gang = self.records.read(job_id)
            if gang is None or gang.attempt != seat.attempt:
                return None
            if gang.running and gang.address and gang.secret:
                return gang
            time.sleep(POLL_S)
        return None

    def _follower_stop(self, job_id: str, token: str) -> str | None:
        state = self.runner.state
        if state.out_of_service.is_set():
            return "device_broken"
        if state.shutdown.is_set():
            return "shutdown"
        self.runner.health.inject_fault()
        return ride_out_outage(lambda: self.runner.store.stop_reason(job_id, token), halted=state.shutdown.is_set,
                               what=f"job {job_id}")
