"""Accepting a training job: check what the user asked for against the models, datasets, devices
and earlier jobs and memory we have, resolve its parameters once (core/kinds/train/resolution.py),
and hand it to the job store. The architecture is looked up once, here, and passed on.

Everything a job would only trip over later on a worker is refused here with a 422 that says
why: an unknown model or dataset, a parent job (`init_from`) or pretrained weights it cannot
start from, a built-in dataset whose files are missing (and may not be downloaded), a validation
fraction that leaves no training image, a gang larger than the devices of its type
(core/gangs/policy.check_world_size), and a job whose data and batches do not fit in the memory
of the workers that could take it (core/admission.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from core.admission import check_admission, job_shape
from core.datasets import DatasetRecord, split_sizes
from core.errors import InvalidInput, NotFound
from core.gangs.policy import check_world_size
from core.kind_words import job_phrase
from core.kinds.submitter import Submitter, check_two_classes, unlabeled_message
from core.kinds.train.params import TrainingParams
from core.kinds.train.resolution import known_model, resolve_params
from core.kinds.train.spec import JobSpec
from core.schemas import Device, Job, JobKind, JobStatus
from models.pretrained import missing_message
from models.registry import ModelSpec


@dataclass(frozen=True)
class CheckedJob:
    """A training request checked against the world: what the job store needs to create it."""

    model: str
    dataset: str
    params: TrainingParams
    device: str
    parent: str | None


class JobSubmission(Submitter):
    def submit(self, spec: JobSpec, idempotency_key: str | None = None,
               tags: Mapping[str, str] | None = None) -> tuple[Job, bool]:
        """The job as created (and True), or the earlier job of the same Idempotency-Key (and False).
        `tags`: fields of the record that say what the job belongs to (a sweep's trial: core/sweeps/)."""
        digest, earlier = self.replay(spec.kind, spec.model_dump(mode="json"), idempotency_key)
        if earlier is not None:  # a retry: its job, whatever changed since it was checked
            return earlier, False
        checked = self.check(spec)
        if spec.priority != "normal":  # a field of the record beside its params: the queue's, not the run's
            tags = {**(tags or {}), "priority": spec.priority}
        job, created = self.store.create(model=checked.model, dataset=checked.dataset, params=checked.params,
                                         requested_device=checked.device, idempotency_key=idempotency_key,
                                         body_digest=digest, depends_on=checked.parent, tags=tags)
        return job, created

    def check(self, spec: JobSpec) -> CheckedJob:
        """Everything POST /jobs checks before it creates a job (InvalidInput saying why not); a sweep
        checks its base body with it before it asks for a trial."""
        model = known_model(spec.model)
        parent = self._parent(spec, model) if spec.init_from else None
        params = resolve_params(spec, model, TrainingParams.of(parent) if parent is not None else None)
        if params.pretrained:
            self._check_pretrained_weights(model)
        # By id, or by its unique name (jobs record the id); marked as used in the same step, so the
        # dataset cannot be deleted between this check and the job's creation.
        dataset = self.catalog.claim_for_job(self.catalog.resolve(spec.dataset).id)
        _check_trainable(dataset, params.val_fraction)
        device = self.devices.validate_request(spec.device)
        check_world_size(params.world_size, device, self.devices.all())
        check_admission(job_shape(model, dataset, params), self._eligible(device), self.settings)
        return CheckedJob(spec.model, dataset.id, params, device, parent.id if parent is not None else None)

    def _parent(self, spec: JobSpec, model: ModelSpec) -> Job:
        """The job `init_from` names, when its weights can start this one; InvalidInput saying why not."""
        assert spec.init_from is not None
        try:
            parent = self.store.get(spec.init_from)
        except (NotFound, InvalidInput):
            raise InvalidInput(f"init_from: job {spec.init_from!r} does not exist") from None
        if parent.kind is not JobKind.train:
            raise InvalidInput(f"init_from: job {parent.id} is {job_phrase(parent.kind, parent.params)}, not a training job")
        if parent.status is not JobStatus.succeeded:
            raise InvalidInput(f"init_from: job {parent.id} is {parent.status.value}; only a succeeded job's "
                               f"weights can start another")
        if parent.model != spec.model:
            raise InvalidInput(f"init_from: job {parent.id} trained {parent.model}, this job trains {spec.model}; "
                               f"the architecture must be the same")
        channels = model.input.channels
        parent_channels = TrainingParams.of(parent).channels or channels  # older records: the model's
        if parent_channels != channels:
            raise InvalidInput(f"init_from: job {parent.id} took {parent_channels}-channel input, {spec.model} "
                               f"here takes {channels}; the input channels must be the same")
        if not self.paths.final(parent.id).exists():
            raise InvalidInput(f"init_from: the checkpoint of job {parent.id} is no longer on this server")
        return parent

    def _check_pretrained_weights(self, model: ModelSpec) -> None:
        weights = model.pretrained
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
