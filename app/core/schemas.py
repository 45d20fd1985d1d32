"""Pydantic models of the HTTP contract (shared/api.md, v1)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


class JobSpec(BaseModel):
    """What a user asks for in POST /jobs. Everything but model and dataset has a default."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(min_length=1, max_length=64)
    dataset: str = Field(min_length=1, max_length=128)
    epochs: int = Field(default=5, ge=1, le=1000)
    batch_size: int | None = Field(default=None, ge=1, le=8192, description="Default: 256 on a GPU, 128 on a CPU.")
    learning_rate: float | None = Field(default=None, gt=0, le=10, description="Default: per optimizer.")
    optimizer: Literal["sgd", "adam", "adamw"] = "adam"
    device: str = Field(default="auto", max_length=200, description='"auto", "cuda", "cpu" or a device id.')
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    val_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    image_size: int | None = Field(default=None, ge=16, le=512, description="Square input size for resizable models.")
    augment: bool = Field(default=False, description="Random crop and horizontal flip, on the device.")


class Progress(BaseModel):
    epoch: int = 0
    epochs: int = 0
    step: int = 0
    steps: int = 0


class EpochMetrics(BaseModel):
    epoch: int
    train_loss: float
    train_accuracy: float
    val_loss: float | None
    val_accuracy: float | None
    images_per_second: float
    seconds: float
    per_class_accuracy: dict[str, float] | None = None


class CheckpointInfo(BaseModel):
    url: str
    sha256: str
    bytes: int


class Job(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    id: str
    status: JobStatus
    model: str
    dataset: str
    params: dict
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
    status: Literal["idle", "busy", "offline"]
    current_job: str | None
    loaded_models: list[str]
    last_heartbeat: datetime
    cuda_visible_devices: str | None = Field(default=None, description="As the worker process saw it.")
    pid: int | None = None
    inference: dict | None = Field(default=None, description="Batches served: count, images, size histogram.")


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


class Health(BaseModel):
    status: str
