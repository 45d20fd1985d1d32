"""One delivery of a job on this worker: its fenced writes and its files.

A `Delivery` is this worker's hold on a job, named by the delivery token it claimed with. Every
write of the job's state goes through the job store's fenced methods with that token, so once
another delivery owns the job (this worker froze and its lease was taken over) a write changes
nothing and raises `NotOwner`. Every file goes under the delivery's own directory
(`CheckpointPaths.staged`); the ones a user reads are promoted into the job's directory only
after `finish` recorded that this delivery ended the job.

A Redis outage pauses the job instead of failing it: each call is ridden out
(worker/runtime/outages.py), the model, optimizer and data stay in memory, and the step that needed
Redis goes on when it is back. Only a worker that is shutting down stops waiting: its lease lapses
and another worker resumes the job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from core.jobs import JobStore, NotOwner
from core.schemas import EpochMetrics, JobStatus, Progress
from core.storage import CheckpointPaths
from worker.runtime.outages import ride_out_outage

log = logging.getLogger(__name__)

T = TypeVar("T")


class Delivery:
    """This worker's hold on one job (see the module docstring). Implements worker/runtime/job_context's
    JobReporter, and backs every write and file method of JobContext."""

    def __init__(self, store: JobStore, paths: CheckpointPaths, job_id: str, token: str, *,
                 halted: Callable[[], bool]) -> None:
        self.store = store
        self.paths = paths
        self.job_id = job_id
        self.token = token
        self._halted = halted
        self._outputs: list[str] = []
        self._resume: Path | None = None

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One job-store call for this job, through a Redis outage."""
        return ride_out_outage(lambda: fn(*args, **kwargs), halted=self._halted, what=f"job {self.job_id}")

    # ------------------------------------------------------------------ JobReporter
    def progress(self, progress: Progress) -> None:
        self.call(self.store.update_progress, self.job_id, self.token, progress)

    def resumed(self, epoch: int) -> None:
        self.call(self.store.set_resumed, self.job_id, self.token, epoch)

    def notice(self, kind: str, data: dict[str, Any], message: str) -> None:
        self.call(self.store.notice, self.job_id, self.token, kind, data, message)

    def epoch(self, metrics: EpochMetrics, resume: Path | None = None) -> None:
        """Record an epoch's metrics and, in the same transaction, the resume state written after
        it; then delete the state it replaces (nobody can resume from that one any more)."""
        pointer = self.paths.relative(self.job_id, resume) if resume is not None else None
        try:
            self.call(self.store.record_epoch, self.job_id, self.token, metrics, pointer)
        except NotOwner:
            if resume is not None:
                resume.unlink(missing_ok=True)  # recorded nowhere: nobody can resume from it
                self._prune()
            raise
        if resume is not None:
            previous, self._resume = self._resume, resume
            if previous is not None and previous != resume:
                previous.unlink(missing_ok=True)

    # ------------------------------------------------------------------ other fenced writes
    def set_params(self, params: dict[str, Any]) -> None:
        self.call(self.store.set_params, self.job_id, self.token, params)

    def set_classes(self, classes: list[str]) -> None:
        self.call(self.store.set_classes, self.job_id, self.token, classes)

    def record(self, fields: dict[str, Any], event: tuple[str, dict[str, Any]] | None = None) -> None:
        self.call(self.store.record, self.job_id, self.token, fields, event)

    # ------------------------------------------------------------------ files
    def output_path(self, name: str) -> Path:
        """Where this delivery writes `name`, promoted to the job's directory if it finishes the job."""
        path = self.paths.staged(self.job_id, self.token, name)
        if name not in self._outputs:
            self._outputs.append(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def scratch_path(self, name: str) -> Path:
        """Where this delivery writes a working file that is never promoted (removed when the job ends)."""
        path = self.paths.staged(self.job_id, self.token, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def resume_state(self) -> Path | None:
        """The resume state recorded with the job's last recorded epoch (by any delivery), if any."""
        pointer = self.call(self.store.raw_field, self.job_id, "resume")
        if pointer:
            self._resume = self.paths.resolve(self.job_id, pointer)
        else:
            legacy = self.paths.legacy_resume(self.job_id)  # a job queued before deliveries had files
            self._resume = legacy if legacy.exists() else None
        return self._resume

    # ------------------------------------------------------------------ lifecycle (worker/runtime/job_runner.py)
    def stop_reason(self) -> str | None:
        return self.call(self.store.stop_reason, self.job_id, self.token)

    def finish(self, status: JobStatus, *, error: str | None = None,
               checkpoint: dict[str, Any] | None = None) -> bool:
        """End the job if this delivery still owns it, then settle its files: promote the outputs
        (a succeeded job) and remove every delivery's working files. False when another delivery
        owns the job: then only this delivery's own outputs are removed."""
        promote = [name for name in self._outputs if self.paths.staged(self.job_id, self.token, name).exists()]
        ended = self.call(self.store.finish, self.job_id, self.token, status, error=error, checkpoint=checkpoint,
                          promote=promote)
        if ended:
            self.settle(promote if status is JobStatus.succeeded else [])
        else:
            self.discard_outputs()
        return ended

    def settle(self, promote: list[str]) -> None:
        if self.paths.settle_files(self.job_id, self.token, promote):
            self.call(self.store.settled, self.job_id)

    def requeue(self, reason: str) -> bool:
        return self.call(self.store.requeue, self.job_id, self.token, reason)

    def discard_outputs(self) -> None:
        """A stale delivery's outputs can never be promoted; its working files may still be the
        owner's resume source (it recorded them before it lost the job), so they stay until the
        job's files are settled."""
        for name in self._outputs:
            self.paths.staged(self.job_id, self.token, name).unlink(missing_ok=True)
        self._prune()

    def _prune(self) -> None:
        """Remove this delivery's directory (and the job's deliveries/) if nothing is left in them."""
        own = self.paths.delivery_dir(self.job_id, self.token)
        for directory in (own, own.parent):
            try:
                directory.rmdir()
            except OSError:
                return  # not empty (someone's resume state), or gone already
