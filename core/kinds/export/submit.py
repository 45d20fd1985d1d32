"""Exports, the API's side: a trained job's model as a file that runs without torchyard (TorchScript
or ONNX).

An export is built by a job of kind `export` on a worker (worker/kinds/export.py), never in the API
process: it loads the checkpoint, traces or exports the network behind its normalisation, and
checks the file against the checkpoint before it succeeds. This module is the API's side: which
export job builds a (checkpoint sha256, format) pair, and what GET /jobs/{id}/export answers:

- the export job succeeded → its file (a second GET is served from this cache; a job whose
  checkpoint changed has a new sha256 and so gets a new export);
- it is queued or running → 202 with the export job (Location, Retry-After);
- it failed → 422 with its error (e.g. the measured parity difference), or 501 when the worker
  lacked the `export` extra; `retry=true` builds it again;
- none yet, or it was cancelled → a new export job, 202.

The export job's parameters (core/kinds/export/params.py `ExportParams`) are written here at creation and read
by the worker (worker/kinds/export.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import redis

from core import keys
from core.errors import Conflict, InvalidInput, NotAvailableHere, NotFound, Unavailable
from core.jobs import JobStore
from core.kind_words import job_phrase
from core.kinds.export.params import ExportParams
from core.schemas import ExportFormat, Job, JobKind, JobStatus
from core.storage import CheckpointPaths

# An export job whose error starts with this failed because the worker lacks the `export` extra:
# GET answers 501 for it (the other failures are 422).
UNAVAILABLE_PREFIX = "export unavailable: "
_FILENAMES = {ExportFormat.torchscript: "model.torchscript.pt", ExportFormat.onnx: "model.onnx"}
MEDIA_TYPES = {ExportFormat.torchscript: "application/octet-stream", ExportFormat.onnx: "application/octet-stream"}
_LOCK_TTL_S = 30


def export_path(paths: CheckpointPaths, export_job_id: str, fmt: ExportFormat) -> Path:
    """Where an export job writes its file: under its own job directory."""
    return paths.job_dir(export_job_id) / _FILENAMES[fmt]


def download_name(source: Job, fmt: ExportFormat) -> str:
    suffix = ".torchscript.pt" if fmt is ExportFormat.torchscript else ".onnx"
    return f"{source.model}-{source.id}{suffix}"


class ExportCatalog:
    def __init__(self, client: redis.Redis, store: JobStore, paths: CheckpointPaths) -> None:
        self.redis = client
        self.store = store
        self.paths = paths

    def request(self, job_id: str, fmt: ExportFormat, *, retry: bool = False) -> tuple[Job, Job, Path | None]:
        """(source job, export job, the file when it is ready). Creates the export job when needed."""
        source = self.store.get(job_id)
        if source.kind is not JobKind.train:
            raise Conflict(f"job {job_id} is {job_phrase(source.kind, source.params)}; only a training job's model can "
                           f"be exported")
        if source.status is not JobStatus.succeeded or source.checkpoint is None:
            raise Conflict(f"job {job_id} is {source.status.value}; only a succeeded job's model can be exported")
        sha = source.checkpoint.sha256
        existing = self._current(sha, fmt, source.project)
        if existing is not None:
            if existing.status is JobStatus.succeeded:
                path = export_path(self.paths, existing.id, fmt)
                if path.exists():
                    return source, existing, path
            elif not existing.status.terminal:
                return source, existing, None
            elif existing.status is JobStatus.failed and not retry:
                error = existing.error or "failed"
                if error.startswith(UNAVAILABLE_PREFIX):
                    raise NotAvailableHere(f"{error[len(UNAVAILABLE_PREFIX):]} (export job {existing.id}; "
                                           f"GET again with retry=true once it is installed)")
                raise InvalidInput(f"exporting job {job_id} as {fmt.value} failed: {error} "
                                   f"(export job {existing.id}; retry=true builds it again)")
        return source, self._create(source, sha, fmt), None

    def derived_from(self, job: Job) -> list[str]:
        """The export jobs built from `job`'s checkpoint, deleted with it (core/retention.JobDeletion):
        an export is its model in another format, read by nothing else. An export another job with
        the same checkpoint asked for first is that job's, and stays."""
        if job.kind is not JobKind.train or job.checkpoint is None:
            return []
        exports = (self._current(job.checkpoint.sha256, fmt, job.project) for fmt in ExportFormat)
        return [e.id for e in exports if e is not None and ExportParams.of(e).source_job_id == job.id]

    def _current(self, sha: str, fmt: ExportFormat, project: str) -> Job | None:
        export_id = self.redis.get(keys.export(sha, fmt.value, project))
        if not export_id:
            return None
        try:
            return self.store.get(export_id)
        except NotFound:  # deleted since: build it again
            return None

    def _create(self, source: Job, sha: str, fmt: ExportFormat) -> Job:
        """One export job per (sha256, format) even when several API processes ask at once."""
        lock = keys.export_lock(sha, fmt.value, source.project)
        if not self.redis.set(lock, "1", nx=True, ex=_LOCK_TTL_S):
            for _ in range(100):  # another request is creating it right now
                time.sleep(0.02)
                current = self._current(sha, fmt, source.project)
                if current is not None and not current.status.terminal:
                    return current
            raise Unavailable("another request is creating this export; retry")
        try:
            params = ExportParams(source_job_id=source.id, format=fmt, checkpoint_sha256=sha)
            export, _ = self.store.create(model=source.model, dataset=source.dataset,
                                          params=params, requested_device="auto",
                                          depends_on=source.id)  # the source stays while it is built
            self.redis.set(keys.export(sha, fmt.value, source.project), export.id)
            return export
        finally:
            self.redis.delete(lock)
