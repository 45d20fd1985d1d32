"""Datasets: the built-ins and uploaded image folders, their records in Redis, their files on disk."""

from __future__ import annotations

import difflib
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import redis
from pydantic import BaseModel, model_validator

from core import keys
from core.access.models import DEFAULT_PROJECT
from core.access.projects import home, visible
from core.archives import extract_image_folder, extract_images
from core.clock import utc_now_iso
from core.config import Settings
from core.errors import Conflict, InvalidInput, NotFound
from core.jobs import JobStore
from core.schemas import Job
from core.storage import validate_id
from core.zip_safety import ArchiveLimits

# The synthetic `fake` dataset: what it is here, how it is drawn in worker/data/datasets.py.
FAKE_CLASSES = [f"pattern_{k}" for k in range(10)]
FAKE_IMAGES = 2560
FAKE_PATTERN_SEED = 1234
# Uploads stream into a file with this prefix under the datasets dir (app/api/uploads.py); the
# cleanup (core/retention.py) removes the ones a crash left behind.
UPLOAD_TEMP_PREFIX = ".upload-"


def split_sizes(n: int, val_fraction: float) -> tuple[int, int]:
    """(training, validation) image counts of the seeded split of `n` images (worker/data.split):
    at least one validation image whenever a fraction is asked for and there are two images."""
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n_val == 0 and n > 1:
        n_val = 1
    return n - n_val, n_val


@dataclass(frozen=True)
class TorchvisionBuiltin:
    folder: str  # what torchvision's class looks for under root

    def expected_files(self, root: Path) -> str:
        return str(root / self.folder)


BUILTIN_TORCHVISION = {
    "cifar10": TorchvisionBuiltin("cifar-10-batches-py"),
    "mnist": TorchvisionBuiltin("MNIST/raw"),
    "fashion_mnist": TorchvisionBuiltin("FashionMNIST/raw"),
}


class DatasetRecord(BaseModel):
    id: str
    name: str
    kind: Literal["fake", "torchvision", "upload"]
    classes: list[str] | None = None
    num_images: int | None = None
    class_counts: dict[str, int] | None = None
    skipped: list[dict[str, str]] = []
    created_at: str | None = None
    description: str | None = None
    available: bool = True
    # False: an upload of images without class folders (`labels=none`): batch predictions only.
    labeled: bool = True
    # Uploads under one name are its versions: the name means the highest (see DatasetCatalog.find);
    # an older one keeps its id, so the jobs that used it still name the images they saw.
    version: int = 1
    # An upload's project (one recorded before projects: "default"); a built-in's is None: shared by
    # every project, read-only (core/access/projects.py). Names are unique within a project.
    project: str | None = None
    size_bytes: int | None = None  # an upload's archive, as sent: what a project's dataset_bytes quota counts

    @model_validator(mode="after")
    def _an_upload_has_a_project(self) -> DatasetRecord:
        if self.kind == "upload" and self.project is None:
            self.project = DEFAULT_PROJECT
        return self


BUILTINS: dict[str, DatasetRecord] = {
    "fake": DatasetRecord(id="fake", name="fake", kind="fake", classes=list(FAKE_CLASSES),
                          num_images=FAKE_IMAGES, description="Synthetic, seeded and learnable: one colour "
                          "pattern per class plus noise. For demos and tests."),
    # num_images: the training split torchvision reads (what a job holds in memory, core/admission.py).
    "cifar10": DatasetRecord(id="cifar10", name="CIFAR-10", kind="torchvision", num_images=50_000,
                             description="torchvision CIFAR10, read from the data dir."),
    "mnist": DatasetRecord(id="mnist", name="MNIST", kind="torchvision", num_images=60_000,
                           description="torchvision MNIST, read from the data dir."),
    "fashion_mnist": DatasetRecord(id="fashion_mnist", name="Fashion-MNIST", kind="torchvision", num_images=60_000,
                                   description="torchvision FashionMNIST, read from the data dir."),
}


# A dataset given to a job this recently is not deleted, even if no queued job shows it yet: the
# job may be between its dataset check and its creation (see claim_for_job).
IN_USE_GRACE_S = 10.0

# The dataset's record, if it exists, and the time it was asked for: one step (claim_for_job).
_CLAIM = """
local record = redis.call('GET', KEYS[1])
if record then
  redis.call('SET', KEYS[2], ARGV[1])
end
return record
"""
# CIFAR-10's class names (torchvision reads them from the set's batches.meta; these are its values).
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
# torchvision's MNIST.classes and FashionMNIST.classes, written out so the API need not import
# torchvision (tests/core/test_datasets.py checks them against torchvision's).
MNIST_CLASSES = ["0 - zero", "1 - one", "2 - two", "3 - three", "4 - four", "5 - five", "6 - six", "7 - seven",
                 "8 - eight", "9 - nine"]
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot"]


def builtin_classes(dataset_id: str) -> list[str] | None:
    """A built-in's class names without reading its files (evaluation checks classes at submit)."""
    if dataset_id == "fake":
        return list(FAKE_CLASSES)
    if dataset_id == "cifar10":
        return list(CIFAR10_CLASSES)
    if dataset_id == "mnist":
        return list(MNIST_CLASSES)
    if dataset_id == "fashion_mnist":
        return list(FASHION_MNIST_CLASSES)
    return None


def _refuse_taken_name(name: str, records: list[DatasetRecord]) -> None:
    """409 when `name` already means a dataset: a built-in's id or name, or an upload's name (its
    newest version named, and how to add a version instead)."""
    builtin = next((r for r in records if r.kind != "upload" and name in (r.id, r.name)), None)
    if builtin is not None:
        raise Conflict(f"dataset name {name!r} is the built-in dataset {builtin.id!r}; pick another name")
    same = [r for r in records if r.kind == "upload" and r.name == name]
    if same:
        newest = max(same, key=lambda r: (r.version, r.created_at or ""))
        raise Conflict(f"dataset name {name!r} is taken by dataset {newest.id} (version {newest.version}); pick "
                       f"another name, or upload it as a new version of {name!r} (new_version=true; the CLI's "
                       f"--new-version): the name then means the new set, and {newest.id} keeps its id")


class DatasetCatalog:
    def __init__(self, client: redis.Redis, settings: Settings, jobs: JobStore) -> None:
        self.redis = client
        self.settings = settings
        self.jobs = jobs
        self._claim = client.register_script(_CLAIM)
        # A project's quota check before an upload is extracted (project, archive bytes; core/access/quotas.py)
        self.admit: Callable[[str, int], None] | None = None

    def get(self, dataset_id: str) -> DatasetRecord:
        if dataset_id in BUILTINS:
            return self._builtin(dataset_id)
        validate_id(dataset_id, "dataset id")
        raw = self.redis.get(keys.dataset(dataset_id))
        record = DatasetRecord.model_validate_json(raw) if raw is not None else None
        if record is None or not visible(record.project):  # another project's: not there for this request
            raise NotFound(f"dataset {dataset_id} not found")
        return record

    def find(self, ref: str) -> DatasetRecord:
        """A dataset by id, else by name (an upload's or a built-in's): the newest version of the sets
        uploaded under it. NotFound, with the nearest name when one is close, for anything else."""
        try:
            return self.get(ref)
        except (NotFound, InvalidInput):
            pass
        records = self.list()
        matches = [record for record in records if record.name == ref]
        if matches:
            return max(matches, key=lambda record: (record.version, record.created_at or ""))
        names = sorted({record.name for record in records} | {record.id for record in records if record.kind != "upload"})
        near = difflib.get_close_matches(ref, names, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else "."
        raise NotFound(f"unknown dataset {ref!r} (neither an id nor a dataset name){hint} The datasets: GET /datasets")

    def resolve(self, ref: str) -> DatasetRecord:
        """`find` for a field of a request body: an unknown reference is the body's fault (422)."""
        try:
            return self.find(ref)
        except NotFound as exc:
            raise InvalidInput(exc.detail) from None

    def annotate(self, jobs: list[Job]) -> list[Job]:
        """Set each job's `dataset_name` from the catalog (None once a dataset is deleted)."""
        uploads = sorted({j.dataset for j in jobs if j.dataset not in BUILTINS})
        raws = self.redis.mget([keys.dataset(i) for i in uploads]) if uploads else []
        names = {i: DatasetRecord.model_validate_json(raw).name for i, raw in zip(uploads, raws, strict=True) if raw}
        names.update({i: record.name for i, record in BUILTINS.items()})
        for job in jobs:
            job.dataset_name = names.get(job.dataset)
        return jobs

    def list(self) -> list[DatasetRecord]:
        ids = sorted(self.redis.smembers(keys.DATASETS_INDEX))
        raws = self.redis.mget([keys.dataset(i) for i in ids]) if ids else []
        uploads = [record for record in (DatasetRecord.model_validate_json(r) for r in raws if r)
                   if visible(record.project)]
        return [self._builtin(name) for name in BUILTINS] + uploads

    def new_upload_path(self) -> Path:
        """A fresh file under the datasets dir for an upload to stream into (same filesystem as the
        extraction, so nothing is copied across disks; a crash leftover is swept by the cleanup)."""
        self.settings.datasets_dir.mkdir(parents=True, exist_ok=True)
        return self.settings.datasets_dir / f"{UPLOAD_TEMP_PREFIX}{secrets.token_hex(8)}.zip"

    def claim_for_job(self, dataset_id: str) -> DatasetRecord:
        """The dataset a job is being submitted for, marked as used now, in one step: the mark and
        the existence check are one Redis script, so `delete` (which refuses a dataset used in the
        last IN_USE_GRACE_S) can never remove it between this check and the job's creation.
        Raises NotFound for an unknown id (and writes nothing for it)."""
        if dataset_id in BUILTINS:
            return self._builtin(dataset_id)
        validate_id(dataset_id, "dataset id")
        raw = self._claim(keys=[keys.dataset(dataset_id), keys.dataset_last_used(dataset_id)],
                          args=[f"{time.time():.3f}"])
        record = DatasetRecord.model_validate_json(raw) if raw is not None else None
        if record is None or not visible(record.project):
            raise NotFound(f"dataset {dataset_id} not found")
        return record

    def last_used(self, dataset_id: str) -> float | None:
        raw = self.redis.get(keys.dataset_last_used(dataset_id))
        return float(raw) if raw else None

    def upload(self, archive: BinaryIO | Path, name: str | None, *, labeled: bool = True,
               new_version: bool = False) -> DatasetRecord:
        """Extract safely into the data dir, then record. Nothing is recorded for a refused zip, nor
        under a name another upload has, unless `new_version` says this is its next version.
        Unlabelled (`labeled=False`): images at any depth, kept at their paths, no classes; such a
        set can only be predicted on, and the record says so (training and evaluation refuse it)."""
        if name is not None and not (0 < len(name) <= 200):
            raise InvalidInput("name must be 1 to 200 characters")
        size = archive.stat().st_size if isinstance(archive, Path) else None
        if self.admit is not None and size is not None:
            self.admit(home(), size)
        if name is not None and not new_version:  # early, before extracting; checked again as it is recorded
            _refuse_taken_name(name, [r for r in self.list() if r.project in (None, home())])
        dataset_id = f"ds{secrets.token_hex(8)}"
        limits = ArchiveLimits(
            max_entries=self.settings.max_zip_entries,
            max_uncompressed_bytes=self.settings.max_zip_uncompressed_bytes,
            max_ratio=self.settings.max_zip_ratio,
            max_image_pixels=self.settings.max_image_pixels,
        )
        extract = extract_image_folder if labeled else extract_images
        extracted = extract(archive, self.settings.datasets_dir / dataset_id, limits)
        record = DatasetRecord(
            id=dataset_id, name=name or dataset_id, kind="upload",
            classes=extracted.classes if labeled else None, num_images=extracted.num_images,
            class_counts=extracted.class_counts if labeled else None,
            skipped=[{"path": s.path, "reason": s.reason} for s in extracted.skipped], created_at=utc_now_iso(),
            labeled=labeled, project=home(), size_bytes=size,
        )
        try:
            return self._record_upload(record, name, new_version)
        except BaseException:
            shutil.rmtree(self.settings.datasets_dir / dataset_id, ignore_errors=True)
            raise

    def _record_upload(self, record: DatasetRecord, name: str | None, new_version: bool) -> DatasetRecord:
        """Record `record` under its name, unless the name is taken and the upload does not say it is
        a new version of it (409 naming the set that has it). Every upload and delete changes the
        index, which this transaction watches: two uploads under one name cannot both see it free,
        nor two uploads at once both fit in the room the project's `dataset_bytes` has left (judged
        here again, its quota watched too; the caller removes the extracted files of a refusal)."""
        def txn(pipe: redis.client.Pipeline) -> DatasetRecord:
            if self.admit is not None and record.size_bytes is not None:
                self.admit(record.project or DEFAULT_PROJECT, record.size_bytes)
            ids = sorted(pipe.smembers(keys.DATASETS_INDEX))
            raws = pipe.mget([keys.dataset(i) for i in ids]) if ids else []
            uploads = [u for u in (DatasetRecord.model_validate_json(r) for r in raws if r) if u.project == record.project]
            versioned = record
            if name is not None and not new_version:
                _refuse_taken_name(name, [*BUILTINS.values(), *uploads])
            elif name is not None:
                if any(name in (b.id, b.name) for b in BUILTINS.values()):
                    _refuse_taken_name(name, list(BUILTINS.values()))
                versions = [r.version for r in uploads if r.name == name]
                versioned = record.model_copy(update={"version": max(versions, default=0) + 1})
            pipe.multi()
            pipe.set(keys.dataset(record.id), versioned.model_dump_json())
            pipe.sadd(keys.DATASETS_INDEX, record.id)
            return versioned

        recorded: DatasetRecord = self.redis.transaction(
            txn, keys.DATASETS_INDEX, keys.project_quota(record.project or DEFAULT_PROJECT), value_from_callable=True)
        return recorded

    def delete(self, ref: str) -> None:
        """Remove an uploaded dataset (by id, or by name: its newest version), unless a queued or
        running job trains on it or a submission was just given it (409). The record goes in a
        transaction on the dataset's keys, so a submission's `claim_for_job` either happens before it
        (and is seen) or finds nothing."""
        record = self.find(ref)
        dataset_id = record.id
        if record.kind != "upload":
            raise Conflict(f"dataset {dataset_id} is built in and cannot be deleted")

        def txn(pipe: redis.client.Pipeline) -> None:
            if self.jobs.active_job_on_dataset(dataset_id):
                raise Conflict(f"dataset {dataset_id} is used by a queued or running job")
            used = pipe.get(keys.dataset_last_used(dataset_id))
            if used and time.time() - float(used) < IN_USE_GRACE_S:
                raise Conflict(f"dataset {dataset_id} was just given to a new job; try again in a few seconds")
            pipe.multi()
            pipe.delete(keys.dataset(dataset_id), keys.dataset_last_used(dataset_id))
            pipe.srem(keys.DATASETS_INDEX, dataset_id)

        self.redis.transaction(txn, keys.dataset(dataset_id), keys.dataset_last_used(dataset_id))
        root = self.settings.datasets_dir
        shutil.rmtree(root / dataset_id, ignore_errors=True)
        shutil.rmtree(root / f".{dataset_id}.cache", ignore_errors=True)

    def _builtin(self, dataset_id: str) -> DatasetRecord:
        record = BUILTINS[dataset_id]
        if record.classes is None:
            record = record.model_copy(update={"classes": builtin_classes(dataset_id)})
        if record.kind == "torchvision":
            folder = Path(BUILTIN_TORCHVISION[dataset_id].expected_files(self.settings.builtin_data_dir))
            present = folder.exists()
            return record.model_copy(update={
                "available": present or self.settings.allow_download,
                "description": f"{record.description} Files: {folder}"
                               + ("" if present else " (missing; " + ("will be downloaded)" if self.settings.allow_download
                                                                       else "set TORCHYARD_ALLOW_DOWNLOAD=true or put them there)")),
            })
        return record
