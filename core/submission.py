"""Accepting a training job: check what the user asked for against the models, datasets, devices
and earlier jobs and memory we have, resolve its parameters once (core/kinds/train.py), and hand it
to the job store. `Submitter` is what every kind's submitter holds and does first (this one, and
core/evaluations.py's and core/batch_predict.py's): the store, catalog, devices and settings, and
the Idempotency-Key replay.

Everything a job would only trip over later on a worker is refused here with a 422 that says
why: an unknown model or dataset, a parent job (`init_from`) or pretrained weights it cannot
start from, a built-in dataset whose files are missing (and may not be downloaded), a validation
fraction that leaves no training image, and a job whose data and batches do not fit in the memory
of the workers that could take it (core/admission.py)."""

from __future__ import annotations

from typing import Any

from core.admission import check_admission, job_shape
from core.config import Settings
from core.datasets import DatasetCatalog, DatasetRecord, builtin_classes, split_sizes
from core.devices import DeviceRegistry
from core.errors import InvalidInput, NotFound
from core.gangs import check_world_size
from core.jobs import JobStore, body_digest
from core.kinds.train import JobSpec, resolve_params
from core.schemas import Device, Job, JobKind, JobStatus
from core.storage import CheckpointPaths
from models.pretrained import missing_message
from models.registry import get_model_spec


class Submitter:
    """What the submitters of every kind share: where jobs, datasets, devices and checkpoints are."""

    def __init__(self, store: JobStore, catalog: DatasetCatalog, devices: DeviceRegistry,
                 settings: Settings) -> None:
        self.store = store
        self.catalog = catalog
        self.devices = devices
        self.settings = settings
        self.paths = CheckpointPaths(settings.checkpoints_dir)

    def replay(self, kind: JobKind, body: dict[str, Any], idempotency_key: str | None) -> tuple[str, Job | None]:
        """The request's digest, and the earlier job of the same Idempotency-Key and body if any (a
        retry gets its job, whatever changed since it was checked; another body under the key: 409)."""
        digest = body_digest(kind, body)
        return digest, self.store.replay(idempotency_key, digest)


class JobSubmission(Submitter):
    def submit(self, spec: JobSpec, idempotency_key: str | None = None) -> tuple[Job, bool]:
        """The job as created (and True), or the earlier job of the same Idempotency-Key (and False)."""
        digest, earlier = self.replay(spec.kind, spec.model_dump(mode="json"), idempotency_key)
        if earlier is not None:  # a retry: its job, whatever changed since it was checked
            return earlier, False
        parent = self._parent(spec) if spec.init_from else None
        params = resolve_params(spec, parent)
        if params.pretrained:
            self._check_pretrained_weights(spec.model)
        # By id, or by its unique name (jobs record the id); marked as used in the same step, so the
        # dataset cannot be deleted between this check and the job's creation.
        dataset = self.catalog.claim_for_job(self.catalog.resolve(spec.dataset).id)
        _check_trainable(dataset, params.val_fraction)
        device = self.devices.validate_request(spec.device)
        check_world_size(params.world_size, device, self.devices.all())  # a gang: core/gangs.py
        check_admission(job_shape(spec.model, dataset, params), self._eligible(device), self.settings)
        job, created = self.store.create(model=spec.model, dataset=dataset.id, params=params.model_dump(),
                                         requested_device=device, idempotency_key=idempotency_key, kind=spec.kind,
                                         body_digest=digest, depends_on=parent.id if parent is not None else None)
        return job, created

    def _parent(self, spec: JobSpec) -> Job:
        """The job `init_from` names, when its weights can start this one; InvalidInput saying why not."""
        assert spec.init_from is not None
        try:
            parent = self.store.get(spec.init_from)
        except (NotFound, InvalidInput):
            raise InvalidInput(f"init_from: job {spec.init_from!r} does not exist") from None
        if parent.kind is not JobKind.train:
            raise InvalidInput(f"init_from: job {parent.id} is a {parent.kind.value} job, not a training job")
        if parent.status is not JobStatus.succeeded:
            raise InvalidInput(f"init_from: job {parent.id} is {parent.status.value}; only a succeeded job's "
                               f"weights can start another")
        if parent.model != spec.model:
            raise InvalidInput(f"init_from: job {parent.id} trained {parent.model}, this job trains {spec.model}; "
                               f"the architecture must be the same")
        channels = get_model_spec(spec.model).input.channels
        parent_channels = parent.params.get("channels", channels)
        if parent_channels != channels:
            raise InvalidInput(f"init_from: job {parent.id} took {parent_channels}-channel input, {spec.model} "
                               f"here takes {channels}; the input channels must be the same")
        if not self.paths.final(parent.id).exists():
            raise InvalidInput(f"init_from: the checkpoint of job {parent.id} is no longer on this server")
        return parent

    def _check_pretrained_weights(self, model: str) -> None:
        weights = get_model_spec(model).pretrained
        assert weights is not None  # resolve_params refused the others
        if not self.settings.allow_download and not weights.path(self.settings.hub_dir).exists():
            raise InvalidInput(missing_message(weights, self.settings.hub_dir))

    def _eligible(self, requested: str) -> list[Device]:
        """The workers that could take a job for `requested`: the live ones, else the last records of
        offline ones (a job for a device that is down waits for it, and must fit it then)."""
        known = self.devices.all()
        matching = [d for d in known if requested == "auto" or d.type == requested or d.id == requested]
        live = [d for d in matching if d.status != "offline"]
        return live or matching


def unlabeled_message(dataset: DatasetRecord, action: str) -> str:
    return (f"dataset {dataset.id} ({dataset.name}) is unlabelled (uploaded with labels=none): there are no classes "
            f"to {action}; run a predict job on it, or upload it as <class>/<image> folders")


def check_two_classes(dataset: DatasetRecord, action: str) -> None:
    """A classifier tells classes apart: on one class every answer is right (accuracy 1.0, loss 0),
    so training or evaluating on fewer than two is refused rather than reported as a success."""
    classes = dataset.classes if dataset.classes is not None else builtin_classes(dataset.id)
    if classes is not None and len(classes) < 2:
        found = f"one class ({classes[0]!r})" if classes else "no class"
        raise InvalidInput(f"dataset {dataset.id} ({dataset.name}) has {found}: {action} needs at least two classes, "
                           f"one folder of images per class (<class>/<image>); a one-class upload can still be "
                           f"predicted on (a predict job)")


def _check_trainable(dataset: DatasetRecord, val_fraction: float) -> None:
    if not dataset.available:
        raise InvalidInput(f"dataset {dataset.id} is not available: {dataset.description}")
    if not dataset.labeled:
        raise InvalidInput(unlabeled_message(dataset, "train on"))
    check_two_classes(dataset, "training")
    if dataset.num_images:
        n_train, n_val = split_sizes(dataset.num_images, val_fraction)
        if n_train < 1:
            raise InvalidInput(f"val_fraction {val_fraction:g} of {dataset.id}'s {dataset.num_images} images leaves "
                               f"no training image ({n_val} for validation); use a smaller val_fraction")
