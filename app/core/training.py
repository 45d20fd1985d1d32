"""Submitting a training job: validate what the user asked for against the models, datasets and
devices we have, resolve the defaults, and hand it to the job store."""

from __future__ import annotations

from app.core.datasets import DatasetCatalog
from app.core.devices import DeviceRegistry
from app.core.errors import InvalidInput, NotFound
from app.core.jobs import JobStore
from app.core.schemas import Job, JobSpec
from models.registry import MODELS, UnknownModel, get_model_spec

DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}


def resolve_params(spec: JobSpec) -> dict:
    """Every hyper-parameter with its value; batch_size stays open until a device takes the job."""
    model = get_model_spec(spec.model)
    if spec.image_size is not None and model.input.fixed_size and spec.image_size != model.input.height:
        raise InvalidInput(f"{spec.model} takes {model.input.height}×{model.input.width} input only; "
                           f"leave image_size unset")
    params = spec.model_dump(exclude={"model", "dataset", "device"})
    params["learning_rate"] = spec.learning_rate or DEFAULT_LR[spec.optimizer]
    params["image_size"] = spec.image_size or model.input.height
    return params


class TrainingService:
    def __init__(self, store: JobStore, catalog: DatasetCatalog, devices: DeviceRegistry) -> None:
        self.store = store
        self.catalog = catalog
        self.devices = devices

    def submit(self, spec: JobSpec, idempotency_key: str | None = None) -> tuple[Job, bool]:
        try:
            params = resolve_params(spec)
        except UnknownModel:
            raise InvalidInput(f"unknown model {spec.model!r}; available: {', '.join(MODELS)}") from None
        try:
            self.catalog.get(spec.dataset)
        except NotFound:
            raise InvalidInput(f"unknown dataset {spec.dataset!r}; see GET /datasets") from None
        device = self.devices.validate_request(spec.device)
        return self.store.create(model=spec.model, dataset=spec.dataset, params=params,
                                 requested_device=device, idempotency_key=idempotency_key)
