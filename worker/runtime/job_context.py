"""What a job handler gets from the runner, and what it hands back.

A job of any kind (training today; batch predictions, evaluations and exports build on the same
lifecycle) is claimed, leased, cancelled and finished by worker/runtime/job_runner.py; the handler for its
kind (`worker/kinds/<kind>.py`) only does the work. It asks `ctx.should_stop()` between units of
work (a step, a batch) and raises `StopJob` with the reason it got, and returns a `JobOutcome`.
Failures are exceptions: `JobFailed` (and the known ones in job_runner.py) end the job `failed`
with their message.

Writing, the only ways (each is fenced by this delivery's token, see worker/runtime/delivery.py):

- job state: `ctx.reporter.progress(...)` / `.epoch(...)` / `.resumed(...)`, `ctx.set_params(...)`,
  `ctx.set_classes(...)`, and `ctx.record(fields, event)` for a kind's own fields (add a JSON
  field's name to core/jobs/records.JSON_FIELDS so readers decode it, and to core/schemas.Job);
- files: `ctx.output_path(name)` for a file users read (`model.pt`, `results.jsonl`, ...): write
  it there (atomically, core/storage.atomic_path), and it is moved to the job's directory as
  `name` if and only if this delivery finishes the job `succeeded`; `ctx.scratch_path(name)` for
  a working file that is never promoted and is removed when the job ends.

Once another delivery owns the job (this worker froze and its lease was taken over), a write
raises `core.jobs.NotOwner` and changes nothing; let it propagate (the runner stops the job).
A Redis outage makes a write wait until Redis is back: the handler keeps its state in memory.
Read with `ctx.store` (`ctx.store.get(other_job_id)`): never write through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from core.config import Settings
from core.datasets import DatasetCatalog
from core.jobs import JobStore
from core.schemas import CheckpointInfo, EpochMetrics, Job, Progress
from core.storage import CheckpointPaths
from worker.device.pinning import WorkerDevice
from worker.runtime.delivery import Delivery


class StopJob(Exception):
    """The job must stop now: `reason` is cancelled, shutdown, lease_lost or device_broken (see JobRunner)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class JobFailed(Exception):
    """The job cannot succeed; its message is what the user reads in `error`."""


class JobReporter(Protocol):
    def progress(self, progress: Progress) -> None: ...
    def epoch(self, metrics: EpochMetrics, resume: Path | None = None) -> None: ...
    def resumed(self, epoch: int) -> None: ...
    def notice(self, kind: str, data: dict[str, Any], message: str) -> None: ...


@dataclass(frozen=True)
class JobContext:
    job_id: str
    token: str  # this delivery's token: every write of the job's state is made on its behalf
    settings: Settings
    device: WorkerDevice
    store: JobStore  # for reading; writes go through the methods below
    catalog: DatasetCatalog
    paths: CheckpointPaths
    reporter: JobReporter
    should_stop: Callable[[], str | None]
    delivery: Delivery

    def set_params(self, params: dict[str, Any]) -> None:
        """Replace the job's params (an export adds its parity check); a training job's are never rewritten."""
        self.delivery.set_params(params)

    def set_classes(self, classes: list[str]) -> None:
        self.delivery.set_classes(classes)

    def record(self, fields: dict[str, Any], event: tuple[str, dict[str, Any]] | None = None) -> None:
        """Write fields of the job record, and append an event to its stream, in one fenced write."""
        self.delivery.record(fields, event)

    def set_training_outcome(self, best_epoch: int | None, stop_reason: str) -> None:
        """Which epoch's weights the checkpoint keeps, and why training ended."""
        self.delivery.call(self.store.set_training_outcome, self.job_id, self.token, best_epoch, stop_reason)

    def set_evaluation(self, evaluation: dict[str, Any]) -> None:
        """A checkpoint measured on labelled data (core/schemas.EvaluationResult), and its event."""
        self.delivery.call(self.store.set_evaluation, self.job_id, self.token, evaluation)

    def output_path(self, name: str) -> Path:
        """Where to write the file users will read as `<job dir>/<name>` (promoted on success)."""
        return self.delivery.output_path(name)

    def scratch_path(self, name: str) -> Path:
        """Where to write a working file of this delivery (never promoted; removed when the job ends)."""
        return self.delivery.scratch_path(name)

    def resume_state(self) -> Path | None:
        """The resume state recorded with the job's last recorded epoch, if an earlier delivery left one."""
        return self.delivery.resume_state()


@dataclass(frozen=True)
class JobOutcome:
    """How a job that succeeded ended: the file a user downloads, if it made one."""

    checkpoint: CheckpointInfo | None = None


# A handler runs one claimed job of its kind on this worker's device.
JobHandler = Callable[[Job, JobContext], JobOutcome]
