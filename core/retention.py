"""Deleting jobs, and the cleanup that keeps Redis and the data dir from growing without end.

One function deletes a job, `JobDeletion.delete`, used by `DELETE /jobs/{id}` and by the
cleanup alike. Before it removes anything it asks each of its protections whether the job must
stay; the first that says why answers 409 with that reason. The protections today:

1. a queued or running job is never deleted: cancel it first;
2. a job whose checkpoint a queued or running job starts from (its parent, `params.init_from`)
   stays until that job has finished.

Other modules add theirs with `JobDeletion.protect` (a function of the job that returns a reason
or None): the aliases add "an alias points at this job", for instance. The record, its events and its
index entries go in one Redis transaction (JobStore.delete); then its files (the job's directory
under checkpoints/: model.pt, resume.pt, an export's file, a predict job's results.jsonl). A crash
between the two leaves an orphan directory, which the cleanup removes. Then the jobs that exist
only for it (`JobDeletion.cascade`: a training job's export jobs, core/kinds/export/submit.py) are deleted the
same way; evaluations and batch predictions stay (their results are the user's).

The cleanup (`Retention.run_once`), every `cleanup_interval_s` in one API process at a time (a
Redis key with that TTL decides which): finished jobs past their keep_*_days, the event history of
finished jobs past keep_job_events_days (the terminal event stays, so a follower still sees the
end), uploaded datasets no job asked for in keep_unused_datasets_days, resume.pt of jobs that
will never resume (failed, cancelled), and what crashes leave behind after STALE_AFTER_S: upload
temp files, half-extracted datasets, atomic-write temp files, orphan job directories and dataset
caches. It never removes a dataset a queued or running job trains on (DatasetCatalog.delete
refuses) nor a job a protection keeps.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import redis

from core import keys
from core.access import audit
from core.config import Settings
from core.datasets import UPLOAD_TEMP_PREFIX, DatasetCatalog
from core.errors import Conflict, NotFound
from core.jobs import JobStore
from core.kinds import TrainingParams, params_of
from core.schemas import Job, JobStatus
from core.storage import CheckpointPaths

log = logging.getLogger(__name__)

DAY_S = 86_400.0
# Temp files and half-written directories older than this are a crash's leftovers: every writer
# touches its file far more often (an upload flushes each MiB, an extraction writes each image).
STALE_AFTER_S = 3600.0

# Why a job must stay (a sentence for the 409), or None.
JobProtection = Callable[[Job], str | None]
# The ids of jobs that exist only for this one and are deleted with it.
DerivedJobs = Callable[[Job], list[str]]


class JobDeletion:
    """The one way a job is deleted. See the module docstring for the protections."""

    def __init__(self, store: JobStore, paths: CheckpointPaths) -> None:
        self.store = store
        self.paths = paths
        self.protections: list[JobProtection] = [_not_active, self._parent_of_active_job]
        self.cascades: list[DerivedJobs] = []

    def protect(self, protection: JobProtection) -> None:
        """Add a rule that can keep a job from deletion (checked after the built-in ones)."""
        self.protections.append(protection)

    def cascade(self, derived: DerivedJobs) -> None:
        """Add a rule naming jobs that only exist for this one (its exports) and go with it."""
        self.cascades.append(derived)

    def refusal(self, job: Job) -> str | None:
        for protection in self.protections:
            if (reason := protection(job)) is not None:
                return reason
        return None

    def delete(self, job_id: str) -> Job:
        """Delete a finished job's record, events and files. NotFound, or Conflict with the reason."""
        job = self.store.get(job_id)
        if (reason := self.refusal(job)) is not None:
            raise Conflict(reason)
        derived = [derived_id for rule in self.cascades for derived_id in rule(job)]
        deleted = self.store.delete(job_id)  # refuses, atomically, a job that became active meanwhile
        shutil.rmtree(self.paths.job_dir(job_id), ignore_errors=True)
        for derived_id in derived:  # after the job itself: a crash in between leaves only what retention expires
            try:
                self.delete(derived_id)
            except (NotFound, Conflict) as exc:  # gone already, or kept by a protection of its own
                log.info("job %s: derived job %s stays (%s)", job_id, derived_id, exc)
        return deleted

    def _parent_of_active_job(self, job: Job) -> str | None:
        for active in self.store.active_jobs():
            params = params_of(active)
            if isinstance(params, TrainingParams) and params.init_from == job.id:
                return (f"job {job.id} is the starting checkpoint of {active.status.value} job {active.id}; "
                        f"delete it after that job has finished")
        return None


def _not_active(job: Job) -> str | None:
    if job.status.terminal:
        return None
    return f"job {job.id} is {job.status.value}; cancel it first (POST /jobs/{job.id}/cancel), then delete it"


@dataclass
class CleanupReport:
    jobs_deleted: list[str] = field(default_factory=list)
    events_trimmed: int = 0
    datasets_deleted: list[str] = field(default_factory=list)
    files_removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # what a protection kept, and why


# After a failed pass, the next is tried this much later (at most the interval).
CLEANUP_RETRY_S = 60.0


class Retention:
    def __init__(self, settings: Settings, client: redis.Redis, store: JobStore, catalog: DatasetCatalog,
                 deletion: JobDeletion) -> None:
        self.settings = settings
        self.redis = client
        self.store = store
        self.catalog = catalog
        self.deletion = deletion
        self.instance = secrets.token_hex(8)

    def run_if_due(self) -> CleanupReport | None:
        """Run a pass unless some API process ran one in the last cleanup_interval_s."""
        interval_ms = max(1, int(self.settings.cleanup_interval_s * 1000))
        if not self.redis.set(keys.RETENTION_LOCK, self.instance, nx=True, px=interval_ms):
            return None
        try:
            report = self.run_once()
        except Exception:
            # A failed pass is tried again soon (by any API process), not an interval later: the lock
            # it took for the interval is shortened to the retry delay.
            retry_ms = max(1, int(min(self.settings.cleanup_interval_s, CLEANUP_RETRY_S) * 1000))
            self.redis.set(keys.RETENTION_LOCK, self.instance, px=retry_ms)
            raise
        if report.jobs_deleted or report.datasets_deleted or report.files_removed or report.events_trimmed:
            log.info("cleanup: %d job(s), %d dataset(s), %d file(s) removed, %d event stream(s) trimmed",
                     len(report.jobs_deleted), len(report.datasets_deleted), len(report.files_removed),
                     report.events_trimmed)
        return report

    def run_once(self, now: float | None = None) -> CleanupReport:
        now = time.time() if now is None else now
        report = CleanupReport()
        self._expire_jobs(now, report)
        self._trim_events(now, report)
        self._expire_datasets(now, report)
        self._sweep_checkpoints(now, report)
        self._sweep_datasets_dir(now, report)
        audit.trim(self.redis, now, self.settings.keep_audit_days)  # its cap bounds it between passes
        return report

    # ------------------------------------------------------------------ Redis records
    def _expire_jobs(self, now: float, report: CleanupReport) -> None:
        keep = {JobStatus.succeeded: self.settings.keep_succeeded_jobs_days,
                JobStatus.failed: self.settings.keep_failed_jobs_days,
                JobStatus.cancelled: self.settings.keep_failed_jobs_days}
        for status, days in keep.items():
            if days <= 0:
                continue
            for job_id in list(self.store.finished_before(status, now - days * DAY_S)):
                try:
                    self.deletion.delete(job_id)
                    report.jobs_deleted.append(job_id)
                except Conflict as kept:
                    report.kept.append(kept.detail)
                except NotFound:
                    continue  # deleted meanwhile (a DELETE request)

    def _trim_events(self, now: float, report: CleanupReport) -> None:
        days = self.settings.keep_job_events_days
        if days <= 0:
            return
        for status in (s for s in JobStatus if s.terminal):
            for job_id in self.store.finished_before(status, now - days * DAY_S):
                self.store.trim_events(job_id)
                report.events_trimmed += 1

    def _expire_datasets(self, now: float, report: CleanupReport) -> None:
        days = self.settings.keep_unused_datasets_days
        if days <= 0:
            return
        for record in self.catalog.list():
            if record.kind != "upload":
                continue
            created = _timestamp(record.created_at)
            last = max(self.catalog.last_used(record.id) or 0.0, created or 0.0)
            if now - last < days * DAY_S:
                continue
            try:
                self.catalog.delete(record.id)  # refuses one a queued or running job trains on
                report.datasets_deleted.append(record.id)
            except Conflict as kept:
                report.kept.append(kept.detail)
            except NotFound:
                continue

    # ------------------------------------------------------------------ files
    def _sweep_checkpoints(self, now: float, report: CleanupReport) -> None:
        root = self.settings.checkpoints_dir
        if not root.is_dir():
            return
        for job_dir in root.iterdir():
            if not job_dir.is_dir():
                continue
            status = self.store.raw_field(job_dir.name, "status")
            if status is None:  # no record: deleted, its files were not (a crash in between)
                if _idle_for(job_dir, now) > STALE_AFTER_S:
                    shutil.rmtree(job_dir, ignore_errors=True)
                    report.files_removed.append(str(job_dir))
                continue
            resume = job_dir / "resume.pt"
            if status in (JobStatus.failed.value, JobStatus.cancelled.value) and resume.exists():
                resume.unlink(missing_ok=True)  # nothing resumes a finished job; a re-submit starts over
                report.files_removed.append(str(resume))
            for temp in job_dir.glob(".*.tmp"):  # core/storage.atomic_path's, from a writer that died
                if _idle_for(temp, now) > STALE_AFTER_S:
                    temp.unlink(missing_ok=True)
                    report.files_removed.append(str(temp))

    def _sweep_datasets_dir(self, now: float, report: CleanupReport) -> None:
        root = self.settings.datasets_dir
        if not root.is_dir():
            return
        for entry in root.iterdir():
            name = entry.name
            if not name.startswith("."):
                continue
            leftover = (name.startswith(UPLOAD_TEMP_PREFIX)  # an upload that never finished
                        or name.endswith(".partial")  # an extraction that never finished
                        or (name.endswith(".cache") and not (root / name[1:-len(".cache")]).exists()))
            if leftover and _idle_for(entry, now) > STALE_AFTER_S:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                report.files_removed.append(str(entry))
            elif name.endswith(".cache") and entry.is_dir():
                for temp in entry.glob(".*.tmp"):
                    if _idle_for(temp, now) > STALE_AFTER_S:
                        temp.unlink(missing_ok=True)
                        report.files_removed.append(str(temp))


def _idle_for(path: Path, now: float) -> float:
    """Seconds since anything under `path` was last written (a directory: its newest entry)."""
    try:
        newest = path.stat().st_mtime
        if path.is_dir():
            for folder, dirs, files in os.walk(path):
                for name in (*dirs, *files):
                    try:
                        newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime)
                    except OSError:
                        continue
    except OSError:
        return 0.0
    return now - newest


def _timestamp(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso).timestamp() if iso else None
