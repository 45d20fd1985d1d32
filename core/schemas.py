"""Pydantic models of the HTTP contract (shared/api.md, v1)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core import defaults


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


# Field texts every kind's request shares (core/kinds/).
DEVICE_DESCRIPTION = f'"auto", "cuda", "cpu" or a device id. Default: "{defaults.DEVICE}".'
DATASET_DESCRIPTION = "A dataset id, or the unique name it was uploaded with."


class JobKind(StrEnum):
    """What a job does on a worker. Every kind shares the lifecycle (queued → running → terminal),
    leases, cancellation and events; worker/runtime/job_runner.py picks the handler by kind. A member's
    name is the kind's name in code (its package core/kinds/<name>/); its value is the HTTP
    contract's (a batch prediction's stays "predict")."""

    train = "train"  # a model from a dataset → a checkpoint
    batch_predict = "predict"  # a trained model over a folder of images → a results file (batch inference)
    evaluate = "evaluate"  # a trained model on a dataset → accuracy, loss, confusion matrix
    export = "export"  # a trained model → a file that runs without torchyard (TorchScript, ONNX)


class Progress(BaseModel):
    epoch: int = 0
    epochs: int = 0
    step: int = 0
    steps: int = 0
    # A batch-prediction job's (epoch 1/1, step = images done): images/s over this delivery's run.
    images_done: int | None = None
    images_total: int | None = None
    images_per_second: float | None = None


class PredictSummary(BaseModel):
    """How a batch-prediction job went (Job.results); the file is GET /jobs/{id}/results."""

    trained_job: str
    alias: str | None = None
    images: int  # lines in the file: one per image of the dataset
    errors: int  # lines with an `error` (an image that could not be decoded)
    top_k: int
    labeled: bool  # lines carry the true `label` (the dataset's class folder)
    accuracy: float | None = None  # labelled datasets: top-1 on the images that decoded
    seconds: float  # this delivery's run
    images_per_second: float  # this delivery's images over its run
    resumed_from_image: int | None = None  # a redelivery continued after this many images
    url: str


class EpochMetrics(BaseModel):
    epoch: int
    train_loss: float
    train_accuracy: float
    val_loss: float | None
    val_accuracy: float | None
    images_per_second: float
    seconds: float
    per_class_accuracy: dict[str, float] | None = None
    # rows: true class, columns: predicted class, in the job's `classes` order. Recorded for the
    # final epoch of a training job (up to MAX_CONFUSION_CLASSES classes).
    confusion_matrix: list[list[int]] | None = None
    learning_rate: float | None = None  # at the end of the epoch (the schedule's)


# Beyond this many classes a confusion matrix is not stored in job records (it grows as the square).
MAX_CONFUSION_CLASSES = 200


class EvaluationResult(BaseModel):
    """A checkpoint measured on labelled images: a training job's validation split (its kept
    weights) or an evaluation job's dataset."""

    dataset: str
    split: Literal["validation", "test", "all"]  # test: a built-in's test split; all: every image of an upload
    epoch: int | None = None  # validation: the epoch whose weights the checkpoint holds
    num_images: int
    accuracy: float
    loss: float  # mean cross-entropy, without label smoothing
    classes: list[str]  # the model's classes: the order of per-class rows and columns
    per_class_accuracy: dict[str, float]  # classes with at least one image
    confusion_matrix: list[list[int]] | None  # rows: true, columns: predicted; null beyond MAX_CONFUSION_CLASSES


class Evaluation(BaseModel):
    """An evaluation job as GET /jobs/{id}/evaluations/{eid} shows it (and Job.evaluations lists)."""

    id: str
    job_id: str  # the trained job whose checkpoint is evaluated
    status: JobStatus
    dataset: str
    dataset_name: str | None = None
    device: str | None = None
    error: str | None = None
    created_at: datetime
    finished_at: datetime | None = None
    result: EvaluationResult | None = None


class CheckpointInfo(BaseModel):
    url: str
    sha256: str
    bytes: int


class GangRank(BaseModel):
    """One member of a data-parallel job's gang (Job.ranks): which worker runs which rank."""

    rank: int
    device: str
    worker: str


class DeviceChoices(BaseModel):
    """What the device that took a training job chose for it, beside (never inside) its params: the
    params are decided once at submit; these only a worker can decide (worker/trainer.plan_training).
    Recorded when a delivery starts, so the record says exactly what ran."""

    model_config = ConfigDict(frozen=True)

    device: str = Field(description='The torch device it trained on ("cpu", "cuda").')
    batch_size: int = Field(description="The global batch it trained with: the job's, or its device "
                            "type's default (a job delivered again keeps its first delivery's).")
    schedule: defaults.Schedule = Field(description="The schedule that ran: the job's, or `constant` for a default-"
                                                    "schedule run under its `min_schedule_steps` optimizer steps.")
    amp_dtype: Literal["bfloat16", "float16"] | None = Field(description="Autocast's dtype; null: full fp32.")
    grad_scaler: bool = Field(description="fp16's gradient scaler.")
    channels_last: bool
    cudnn_benchmark: bool
    data_on_device: bool = Field(description="The images resident on the device (else streamed through "
                                             "staging buffers).")
    staging_buffers: int = Field(description="Pinned staging buffers a streamed split goes through (0: resident).")

    @classmethod
    def legacy(cls, params: dict[str, Any]) -> DeviceChoices | None:
        """The choices a record written before they had a field of their own keeps inside its params."""
        if "amp_dtype" not in params or "device" not in params:
            return None
        fields = {name: params[name] for name in cls.model_fields if name in params}
        fields.setdefault("schedule", "constant")  # records older than the recipe ran a constant rate
        try:
            return cls.model_validate(fields)
        except ValueError:
            return None


class MlflowRun(BaseModel):
    """A job's run on the MLflow tracking server, as its record tells (core/tracking.py)."""

    run_id: str | None = Field(default=None, description="The run, once the tracking server created it.")
    experiment_id: str | None = None
    url: str | None = Field(default=None, description="The run's page on the tracking server.")
    status: str | None = Field(default=None, description="The run's status as last sent: RUNNING, then FINISHED, "
                                                         "FAILED or KILLED once it holds everything.")
    epochs_logged: int = Field(default=0, description="Epochs of the job's metrics the run holds.")
    behind: list[str] = Field(default=[], description="What the run does not hold yet (epochs, status, artifacts); "
                                                      "empty once the run is complete.")
    error: str | None = Field(default=None, description="Why the last attempt to reach the server failed, while "
                                                        "something is behind.")


class Job(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    id: str
    kind: JobKind = JobKind.train
    project: str = Field(default="default", description="The project of the key that made it (a job made from "
                                                        "another's checkpoint: that one's).")
    priority: Literal["low", "normal", "high"] = Field(default="normal", description="Its place among its project's "
                                                                                       "queued jobs (POST /jobs).")
    status: JobStatus
    model: str
    dataset: str
    params: dict
    device_choices: DeviceChoices | None = Field(
        default=None, description="A training job: what the device that ran it chose (set when a delivery starts).")
    device: str | None = None
    requested_device: str = "auto"
    progress: Progress = Progress()
    metrics: list[EpochMetrics] = []
    checkpoint: CheckpointInfo | None = None
    classes: list[str] | None = None
    error: str | None = None
    message: str | None = Field(default=None, description="What the job waits for or what happened to it.")
    attempts: int = 0
    resumed_from_epoch: int | None = Field(
        default=None, description="Set when a later delivery continued after this finished epoch.")
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    # --- training outcomes and evaluations (docs/training.md) --------------------------------
    dataset_name: str | None = Field(default=None, description="The dataset's name, when it still exists.")
    best_epoch: int | None = Field(default=None, description="The epoch whose weights the checkpoint holds.")
    stop_reason: str | None = Field(default=None, description="Why training ended: all epochs ran, or early "
                                                              "stopping and why.")
    evaluation: EvaluationResult | None = Field(
        default=None, description="train: the validation split on the kept weights; evaluate: the result.")
    evaluations: list[Evaluation] | None = Field(
        default=None, description="GET /jobs/{id} of a training job: its evaluations, newest first.")
    results: PredictSummary | None = Field(default=None, description="A succeeded predict job: its results file.")
    world_size: int = Field(default=1, description="Devices the job asked to train on together (its params').")
    ranks: list[GangRank] | None = Field(
        default=None, description="A data-parallel job: the ranks of its current (or last) attempt, rank 0 first; "
                                  "fewer than world_size after an elastic resume.")
    mlflow: MlflowRun | None = Field(
        default=None, description="Its MLflow run, when the service tracks to MLflow (TORCHYARD_MLFLOW_TRACKING_URI).")

    # --- a sweep's trial (core/sweeps/) -------------------------------------------------------
    sweep_id: str | None = Field(default=None, description="The sweep this job is a trial of.")
    trial: int | None = Field(default=None, description="Its trial's number in that sweep.")

    @model_validator(mode="before")
    @classmethod
    def _from_params(cls, data: Any) -> Any:
        """The record keeps world_size in its params (decided at submit); the contract shows it on the job.
        A record written before device choices had a field of their own shows those in its params there too."""
        if not isinstance(data, dict) or not isinstance(data.get("params"), dict):
            return data
        if "world_size" not in data:
            data = {**data, "world_size": data["params"].get("world_size") or 1}
        if data.get("device_choices") is None and data.get("kind", JobKind.train) == JobKind.train:
            data = {**data, "device_choices": DeviceChoices.legacy(data["params"])}
        return data


class JobList(BaseModel):
    jobs: list[Job]
    next_cursor: str | None = None


class Device(BaseModel):
    id: str
    type: Literal["cuda", "cpu"]
    index: int | None
    name: str
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    utilization_percent: float | None
    worker: str
    status: Literal["idle", "busy", "offline", "broken"] = Field(
        description="broken: its worker hit a sticky device error and is restarting (see `fault`).")
    current_job: str | None
    loaded_models: list[str]
    last_heartbeat: datetime
    cuda_visible_devices: str | None = Field(default=None, description="As the worker process saw it.")
    pid: int | None = None
    inference: dict | None = Field(default=None, description="Batches served: count, images, size histogram.")
    fault: str | None = Field(default=None, description="The device error that took its worker out of service; "
                                                        "cleared when a fresh worker process starts.")
    host_memory_total_bytes: int | None = Field(
        default=None, description="RAM the worker's process may use (its host's, or its container's limit); "
                                  "what job admission measures a job's data against (core/admission.py).")


class DeviceList(BaseModel):
    devices: list[Device]


class ModelInput(BaseModel):
    channels: int
    height: int
    width: int


class ModelInfo(BaseModel):
    name: str
    description: str
    input: ModelInput
    parameters: int


class ModelList(BaseModel):
    models: list[ModelInfo]


class Prediction(BaseModel):
    label: str
    index: int
    probability: float


class ImagePredictions(BaseModel):
    filename: str | None
    predictions: list[Prediction]


class PredictResponse(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    job_id: str
    model: str
    device: str
    results: list[ImagePredictions]
    alias: str | None = Field(default=None, description="The alias the request named (it resolved to job_id).")


class Health(BaseModel):
    status: str


# --- aliases and exports ---------------------------------------------------------------------
class AliasSet(BaseModel):
    """PUT /aliases/{name}: point the alias at a succeeded training job (create or move it)."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(min_length=1, max_length=128)
    note: str | None = Field(default=None, max_length=500, description="Why, for the history (who is recorded too).")


class AliasNote(BaseModel):
    """POST /aliases/{name}/rollback and DELETE: an optional note for the history."""

    model_config = ConfigDict(extra="forbid")

    note: str | None = Field(default=None, max_length=500)


class AliasMove(BaseModel):
    """One entry of an alias's history: who moved it where, when."""

    action: Literal["set", "rollback", "delete"]
    at: datetime
    from_job_id: str | None
    to_job_id: str | None
    by: str | None = Field(default=None, description="The caller's address, as the API saw it.")
    user_agent: str | None = None
    note: str | None = None


class Alias(BaseModel):
    name: str
    project: str = Field(default="default", description="Its project: a name is unique within one.")
    job_id: str
    model: str = Field(description="The target job's architecture.")
    previous_job_id: str | None = Field(default=None, description="Where a rollback goes.")
    created_at: datetime
    updated_at: datetime
    updated_by: str | None = None
    note: str | None = None
    moves: int = Field(default=1, description="How many times it was set, rollbacks included.")


class WarmResult(BaseModel):
    """How warming the new target went on one device that held the old one."""

    device: str
    status: Literal["resident", "loaded", "failed", "timeout"]
    seconds: float | None = None
    detail: str | None = None


class AliasUpdate(Alias):
    """The answer to a move: the alias as it now is, and the warm-up done before it moved."""

    warm: list[WarmResult] = []


class AliasList(BaseModel):
    aliases: list[Alias]


class AliasHistory(BaseModel):
    name: str
    moves: list[AliasMove] = Field(description="Newest first.")


class ExportFormat(StrEnum):
    torchscript = "torchscript"
    onnx = "onnx"
