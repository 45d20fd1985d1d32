"""A job's record → its MLflow run: what the run lacks, sent once (see core/tracking.py for why the
record is the outbox).

Exactly once, without a ledger of our own: the run is found again by its `torchyard.job_id` tag
when the record does not name it yet (a crash between the server creating it and the record
saying so), and an epoch is sent only when the run's `train_loss` history has no point at that
step (a crash between the server storing a batch and us hearing back). Every epoch's metrics
go in one `log_batch`, which the server stores in one transaction, so "train_loss at step e"
stands for the whole epoch. Params are logged once (MLflow refuses a changed value, and a
training job's params never change); tags, artifacts and the status are idempotent writes.

A training job is a run named after the job. An evaluation is a child run of its trained job's
run (MLflow's `mlflow.parentRunId` tag): one trained job may be evaluated on many datasets, and a
child run keeps each evaluation's metrics and confusion matrix apart, shown under its parent.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from core.schemas import EpochMetrics, EvaluationResult, Job, JobKind, JobStatus, MlflowRun
from core.storage import CheckpointPaths
from core.tracking import JOB_TAG, flatten

# The run's status for each terminal job status (a cancelled job is a KILLED run).
RUN_STATUS = {JobStatus.succeeded: "FINISHED", JobStatus.failed: "FAILED", JobStatus.cancelled: "KILLED"}
ARTIFACTS_TAG = "torchyard.artifacts"
# The metric whose history says which epochs the run holds (always in each epoch's batch).
EPOCH_MARKER = "train_loss"
_BATCH_METRICS = 900  # MLflow takes at most 1000 metrics per log_batch


def epoch_metrics(entry: EpochMetrics, timestamp_ms: int) -> list[Metric]:
    values = {"train_loss": entry.train_loss, "train_accuracy": entry.train_accuracy, "val_loss": entry.val_loss,
              "val_accuracy": entry.val_accuracy, "images_per_second": entry.images_per_second,
              "learning_rate": entry.learning_rate, "epoch_seconds": entry.seconds}
    return [Metric(name, float(value), timestamp_ms, entry.epoch) for name, value in values.items() if value is not None]


class RunWriter:
    """One tracking server's runs, written from job records. Not thread-safe: one tracking thread."""

    def __init__(self, client: MlflowClient, tracking_uri: str, experiment: str, paths: CheckpointPaths) -> None:
        self.client = client
        # Called before each write: the tracker renews its hold on the job there (and raises if it
        # lost it), so two workers never send the same epoch.
        self.before_write: Callable[[], None] = lambda: None
        self.tracking_uri = tracking_uri.rstrip("/")
        self.experiment = experiment
        self.paths = paths
        self._experiment_id: str | None = None

    # ------------------------------------------------------------------ the run
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            if found is None:
                try:
                    self._experiment_id = self.client.create_experiment(self.experiment)
                except MlflowException:  # another worker created it in between
                    found = self.client.get_experiment_by_name(self.experiment)
                    if found is None:
                        raise
                    self._experiment_id = found.experiment_id
            else:
                self._experiment_id = found.experiment_id
        return self._experiment_id

    def forget_experiment(self) -> None:
        """The server lost its store: the experiment is looked up (or created) again."""
        self._experiment_id = None

    def url(self, experiment_id: str, run_id: str) -> str:
        return f"{self.tracking_uri}/#/experiments/{experiment_id}/runs/{run_id}"

    def find_or_create(self, job: Job, known: MlflowRun | None, parent_run: str | None,
                       save: Callable[[MlflowRun], None]) -> MlflowRun:
        """The job's run: the one its record names, the one tagged with its id, or a new one (saved
        to the record at once, before anything else is sent)."""
        if known is not None and known.run_id:
            return known
        experiment_id = self.experiment_id()
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job.id}'",
                                        max_results=2)
        if found:
            run_id = found[0].info.run_id
        else:
            tags = {JOB_TAG: job.id, "torchyard.kind": job.kind.value}
            if parent_run:
                tags["mlflow.parentRunId"] = parent_run
            name = job.id if job.kind is JobKind.train else f"{job.kind.value}-{job.id}"
            self.before_write()
            run_id = self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        run = MlflowRun(run_id=run_id, experiment_id=experiment_id, url=self.url(experiment_id, run_id))
        save(run)
        return run

    # ------------------------------------------------------------------ what it holds
    def ship(self, job: Job, known: MlflowRun | None, save: Callable[[MlflowRun], None],
             parent_run: str | None = None, init_from_run: str | None = None) -> MlflowRun:
        """Send what the run lacks; the record's new `mlflow` (`behind` empty once the run is complete)."""
        run = self.find_or_create(job, known, parent_run, save)
        assert run.run_id is not None
        run_id = run.run_id
        self._log_batch(run_id, params=self._params(job, known), tags=self._tags(job, init_from_run))
        behind: list[str] = []
        status = "RUNNING"
        logged = 0
        if job.kind is JobKind.train:
            logged = self._ship_epochs(run_id, job.metrics)
        elif job.evaluation is not None and not self.client.get_metric_history(run_id, "eval_accuracy"):
            self._log_batch(run_id, metrics=_evaluation_metrics(job.evaluation))
        if job.status.terminal:
            if (job.status is JobStatus.succeeded and not self._artifacts_logged(run_id)
                    and not self._log_artifacts(run_id, job)):
                behind.append("artifacts")
            if not behind:
                self.before_write()
                status = RUN_STATUS[job.status]
                self.client.set_terminated(run_id, status)
        return run.model_copy(update={"status": status, "epochs_logged": logged, "behind": behind, "error": None})

    def _params(self, job: Job, known: MlflowRun | None) -> dict[str, str]:
        if known is not None and known.run_id and known.epochs_logged:
            return {}  # logged with the first epochs already
        return {k: v[:6000] for k, v in flatten("", job.params, {}).items()}

    def _tags(self, job: Job, init_from_run: str | None) -> dict[str, str]:
        tags = {"torchyard.model": job.model, "torchyard.dataset_id": job.dataset,
                "torchyard.attempts": str(job.attempts), "torchyard.status": job.status.value}
        if job.dataset_name:
            tags["torchyard.dataset_name"] = job.dataset_name
        if job.device:
            tags["torchyard.device"] = job.device
            tags["torchyard.node"] = job.device.split("/")[0]
        if job.device_choices is not None:
            flatten("torchyard.device_choices", job.device_choices.model_dump(), tags)
        if job.world_size > 1:
            tags["torchyard.world_size"] = str(job.world_size)
        if init_from_run:
            tags["torchyard.parent_run_id"] = init_from_run
        return {k: v[:5000] for k, v in tags.items()}

    def _ship_epochs(self, run_id: str, epochs: list[EpochMetrics]) -> int:
        held = {m.step for m in self.client.get_metric_history(run_id, EPOCH_MARKER)} if epochs else set()
        missing = [m for m in epochs if m.epoch not in held]
        now = int(time.time() * 1000)
        batch: list[Metric] = []
        for entry in missing:  # whole epochs per batch: the marker stands for its epoch's metrics
            metrics = epoch_metrics(entry, now)
            if batch and len(batch) + len(metrics) > _BATCH_METRICS:
                self._log_batch(run_id, metrics=batch)
                batch = []
            batch.extend(metrics)
        if batch:
            self._log_batch(run_id, metrics=batch)
        return len(held | {m.epoch for m in missing})

    def _log_batch(self, run_id: str, *, metrics: list[Metric] | None = None, params: dict[str, str] | None = None,
                   tags: dict[str, str] | None = None) -> None:
        self.before_write()
        self.client.log_batch(run_id, metrics=metrics or [],
                              params=[Param(k, v) for k, v in (params or {}).items()],
                              tags=[RunTag(k, v) for k, v in (tags or {}).items()])

    # ------------------------------------------------------------------ artifacts
    def _artifacts_logged(self, run_id: str) -> bool:
        return self.client.get_run(run_id).data.tags.get(ARTIFACTS_TAG) == "logged"

    def _log_artifacts(self, run_id: str, job: Job) -> bool:
        """The kept weights (`model/state_dict.pt` + `model/spec.json`), the confusion matrix and
        per-class accuracy; False while the job's files are not in place yet (settled after it ends)."""
        with tempfile.TemporaryDirectory(prefix="torchyard-mlflow-") as tmp:
            root = Path(tmp)
            if job.kind is JobKind.train:
                final = self.paths.final(job.id)
                if not final.exists():
                    return False
                _write_model(final, root / "model")
            if job.evaluation is not None:
                _write_evaluation(job.evaluation, root / "evaluation")
            if any(root.iterdir()):
                self.before_write()
                self.client.log_artifacts(run_id, str(root))
        self._log_batch(run_id, tags={ARTIFACTS_TAG: "logged"})
        return True


def _evaluation_metrics(result: EvaluationResult) -> list[Metric]:
    now = int(time.time() * 1000)
    return [Metric("eval_accuracy", result.accuracy, now, 0), Metric("eval_loss", result.loss, now, 0),
            Metric("eval_images", float(result.num_images), now, 0)]


def _write_model(final: Path, into: Path) -> None:
    """The checkpoint's weights as a plain state_dict, and the spec that rebuilds the network:
    `models.registry.build_model(spec["architecture"], spec["num_classes"], spec["preprocessing"]["channels"])`."""
    import torch

    from worker.checkpoints.format import load_payload

    payload = load_payload(final)
    into.mkdir(parents=True)
    torch.save(payload["state_dict"], into / "state_dict.pt")
    spec: dict[str, Any] = {**payload["meta"], "format": payload["format"], "torch_version": payload["torch_version"],
                            "rebuild": "models.registry.build_model(architecture, num_classes, preprocessing.channels)"
                                       ".load_state_dict(torch.load('state_dict.pt', weights_only=True))"}
    (into / "spec.json").write_text(json.dumps(spec, indent=2))


def _write_evaluation(result: EvaluationResult, into: Path) -> None:
    into.mkdir(parents=True)
    (into / "per_class_accuracy.json").write_text(json.dumps(result.per_class_accuracy, indent=2))
    if result.confusion_matrix is not None:
        (into / "confusion_matrix.json").write_text(json.dumps({"classes": result.classes,
                                                                "rows_true_columns_predicted": result.confusion_matrix}))
