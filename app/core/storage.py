"""Files under the data dir: every write goes to a temporary name and is renamed into place."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from app.core.errors import InvalidInput

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


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointPaths:
    """Where a job's files live: the final weights and the per-epoch resumable state."""

    def __init__(self, checkpoints_dir: Path) -> None:
        self.root = checkpoints_dir

    def job_dir(self, job_id: str) -> Path:
        return self.root / validate_id(job_id, "job id")

    def final(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "model.pt"

    def resume(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "resume.pt"
