"""Datasets: the built-ins and uploaded image folders, their records in Redis, their files on disk."""

from __future__ import annotations


import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import redis
from pydantic import BaseModel

from app.core.archives import ArchiveLimits, extract_image_folder
from app.core.config import Settings
from app.core.errors import Conflict, InvalidInput, NotFound
from app.core.jobs import job_key, now_iso, status_index
from app.core.redis import KEY_PREFIX
from app.core.schemas import JobStatus
from app.core.storage import validate_id

DATASETS_INDEX = f"{KEY_PREFIX}datasets"


def dataset_key(dataset_id: str) -> str:
    return f"{KEY_PREFIX}dataset:{dataset_id}"


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


BUILTINS: dict[str, DatasetRecord] = {
    "fake": DatasetRecord(id="fake", name="fake", kind="fake", classes=[f"pattern_{k}" for k in range(10)],
                          num_images=2560, description="Synthetic, seeded and learnable: one colour "
                          "pattern per class plus noise. For demos and tests."),
    "cifar10": DatasetRecord(id="cifar10", name="CIFAR-10", kind="torchvision",
                             description="torchvision CIFAR10, read from the data dir."),
    "mnist": DatasetRecord(id="mnist", name="MNIST", kind="torchvision",
                           description="torchvision MNIST, read from the data dir."),
    "fashion_mnist": DatasetRecord(id="fashion_mnist", name="Fashion-MNIST", kind="torchvision",
                                   description="torchvision FashionMNIST, read from the data dir."),
}


class DatasetCatalog:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.settings = settings

    def get(self, dataset_id: str) -> DatasetRecord:
        if dataset_id in BUILTINS:
            return self._builtin(dataset_id)
        validate_id(dataset_id, "dataset id")
        raw = self.redis.get(dataset_key(dataset_id))
        if raw is None:
            raise NotFound(f"dataset {dataset_id} not found")
        return DatasetRecord.model_validate_json(raw)

    def list(self) -> list[DatasetRecord]:
        ids = sorted(self.redis.smembers(DATASETS_INDEX))
        raws = self.redis.mget([dataset_key(i) for i in ids]) if ids else []
        uploads = [DatasetRecord.model_validate_json(r) for r in raws if r]
        return [self._builtin(name) for name in BUILTINS] + uploads

    def upload(self, archive: BinaryIO | Path, name: str | None) -> DatasetRecord:
        """Extract safely into the data dir, then record. Nothing is recorded for a refused zip."""
        if name is not None and not (0 < len(name) <= 200):
            raise InvalidInput("name must be 1 to 200 characters")
        dataset_id = f"ds{secrets.token_hex(8)}"
        limits = ArchiveLimits(
            max_entries=self.settings.max_zip_entries,
            max_uncompressed_bytes=self.settings.max_zip_uncompressed_bytes,
            max_ratio=self.settings.max_zip_ratio,
            max_image_pixels=self.settings.max_image_pixels,
        )
        extracted = extract_image_folder(archive, self.settings.datasets_dir / dataset_id, limits)
        record = DatasetRecord(
            id=dataset_id, name=name or dataset_id, kind="upload", classes=extracted.classes,
            num_images=extracted.num_images, class_counts=extracted.class_counts,
            skipped=[{"path": s.path, "reason": s.reason} for s in extracted.skipped], created_at=now_iso(),
        )
        pipe = self.redis.pipeline()
        pipe.set(dataset_key(dataset_id), record.model_dump_json())
        pipe.sadd(DATASETS_INDEX, dataset_id)
        pipe.execute()
        return record

    def delete(self, dataset_id: str) -> None:
        record = self.get(dataset_id)
        if record.kind != "upload":
            raise Conflict(f"dataset {dataset_id} is built in and cannot be deleted")
        if self._in_use(dataset_id):
            raise Conflict(f"dataset {dataset_id} is used by a queued or running job")
        self.redis.delete(dataset_key(dataset_id))
        self.redis.srem(DATASETS_INDEX, dataset_id)
        root = self.settings.datasets_dir
        shutil.rmtree(root / dataset_id, ignore_errors=True)
        shutil.rmtree(root / f".{dataset_id}.cache", ignore_errors=True)

    def _in_use(self, dataset_id: str) -> bool:
        for status in (JobStatus.queued, JobStatus.running):
            for job_id in self.redis.zrange(status_index(status), 0, -1):
                if self.redis.hget(job_key(job_id), "dataset") == dataset_id:
                    return True
        return False

    def _builtin(self, dataset_id: str) -> DatasetRecord:
        record = BUILTINS[dataset_id]
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



