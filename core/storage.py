"""Files under the data dir: every write goes to a temporary name and is renamed into place."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from core.errors import InvalidInput

_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def validate_id(value: str, what: str = "id") -> str:
    """Ids end up in file paths: allow only a conservative alphabet, never '..' or '/'."""
    if not _SAFE_ID.fullmatch(value) or ".." in value:
        raise InvalidInput(f"invalid {what}: {value!r}")
    return value


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; rename it over `target` only if the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(target: Path, write: Callable[[BinaryIO], None]) -> None:
    with atomic_path(target) as tmp, open(tmp, "wb") as fh:
        write(fh)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_tree(root: Path) -> None:
    """Every file and folder under `root`, and `root` itself, on disk: what a record about to be
    written will point at (an extracted dataset) must survive a power loss the record survives."""
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def fsync_dir(directory: Path) -> None:
    """A folder's entries on disk (a rename into it, a file created in it)."""
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DELIVERIES_DIR = "deliveries"
_SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class CheckpointPaths:
    """Where a job's files live.

    What users read sits in the job's directory (`model.pt`, and whatever other kinds promote).
    Every delivery writes only under its own `deliveries/<token>/` (the final weights before
    promotion, the per-epoch resume states), so a stale delivery can never overwrite or delete a
    file the owner wrote; a file reaches the job's directory only by `settle_files`, after the
    job store recorded that this delivery finished the job (worker/runtime/delivery.py)."""

    def __init__(self, checkpoints_dir: Path) -> None:
        self.root = checkpoints_dir

    def job_dir(self, job_id: str) -> Path:
        return self.root / validate_id(job_id, "job id")

    def final(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "model.pt"

    def legacy_resume(self, job_id: str) -> Path:
        """Where the first wave kept the resume state (one file, overwritten by every delivery)."""
        return self.job_dir(job_id) / "resume.pt"

    def delivery_dir(self, job_id: str, token: str) -> Path:
        return self.job_dir(job_id) / DELIVERIES_DIR / validate_id(token, "delivery token")

    def staged(self, job_id: str, token: str, name: str) -> Path:
        """A file of one delivery; `name` is a plain file name (no directories)."""
        return self.delivery_dir(job_id, token) / validate_file_name(name)

    def relative(self, job_id: str, path: Path) -> str:
        """`path` relative to the job's directory (what the job record stores as a pointer)."""
        return path.relative_to(self.job_dir(job_id)).as_posix()

    def resolve(self, job_id: str, relative: str) -> Path:
        """A pointer from the job record back to a path, refusing anything outside the job's deliveries."""
        parts = relative.split("/")
        if len(parts) != 3 or parts[0] != DELIVERIES_DIR:
            raise ValueError(f"not a delivery file of job {job_id}: {relative!r}")
        return self.staged(job_id, parts[1], parts[2])

    def settle_files(self, job_id: str, token: str, promote: list[str]) -> bool:
        """Move the finishing delivery's files into the job's directory, then remove every
        delivery's files (resume states, a stale delivery's leftovers). Idempotent: run by the
        owner right after it finished the job, and by any worker's sweep if the owner died between.
        False when a file to promote is neither staged nor promoted here (another host's disk)."""
        job_dir = self.job_dir(job_id)
        for name in promote:
            staged, target = self.staged(job_id, token, name), job_dir / validate_file_name(name)
            try:
                os.replace(staged, target)
            except FileNotFoundError:
                if not target.exists():
                    return False
                continue  # promoted already, by the owner or an earlier sweep
            _fsync_dir(job_dir)
        shutil.rmtree(job_dir / DELIVERIES_DIR, ignore_errors=True)
        self.legacy_resume(job_id).unlink(missing_ok=True)
        return True


def validate_file_name(name: str) -> str:
    if not _SAFE_FILE_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"invalid job file name: {name!r}")
    return name
