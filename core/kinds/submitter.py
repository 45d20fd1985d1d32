"""What every kind's submitter shares (core/kinds/<kind>/submit.py): where jobs, datasets, devices
and checkpoints are, the Idempotency-Key replay each does first, and the dataset checks two kinds
make (a dataset with labels, of at least two classes)."""

from __future__ import annotations

from typing import Any

from core.config import Settings
from core.datasets import DatasetCatalog, DatasetRecord, builtin_classes
from core.devices import DeviceRegistry
from core.errors import InvalidInput
from core.jobs import JobStore, body_digest
from core.schemas import Job, JobKind
from core.storage import CheckpointPaths


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
