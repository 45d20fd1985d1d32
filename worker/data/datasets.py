"""Datasets → uint8 tensors (N×C×H×W) and labels, at the architecture's channels and size.

Whole datasets live in memory as uint8 (CIFAR-10 is 150 MB) so the trainer can put them on the
device once and slice batches there: no DataLoader, no per-step decoding.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from PIL import Image

from core.config import Settings
from core.datasets import BUILTIN_TORCHVISION, FAKE_CLASSES, FAKE_IMAGES, FAKE_PATTERN_SEED, DatasetRecord, split_sizes
from core.storage import atomic_path
from worker.data.dataset_decode import DecodeFailed, DecodeReport, decode_files
from worker.data.device_dataset_decode import DeviceDecode, decode_files_on_device
from worker.data.image_array import TRANSFORM_VERSION, InputSpec, image_to_array
from worker.device.cpu_threads import usable_cores
from worker.runtime.job_context import StopJob

log = logging.getLogger(__name__)


class DatasetUnavailable(Exception):
    """The dataset's files are not where they must be (and may not be downloaded)."""


class DecodeWaitExpired(DatasetUnavailable):
    """Another worker held the set's lock for longer than this job waits (TORCHYARD_DECODE_LOCK_WAIT_S)."""


# How often a job waiting for another worker's decode of its set tries the lock again, and asks
# whether it must stop (cancelled, shutting down, its lease lost).
LOCK_POLL_S = 0.2


@dataclass
class ImageTensors:
    images: torch.Tensor  # uint8 N×C×H×W
    labels: torch.Tensor  # int64 N
    classes: list[str]
    report: DecodeReport | None = None  # which decoder took an upload's files; None when read from its cache


# ---------------------------------------------------------------------------- fake
def fake_class_patterns(channels: int, height: int, width: int, num_classes: int = 10) -> torch.Tensor:
    """One fixed low-frequency colour pattern per class (float in [0, 1]), the same in every process."""
    gen = torch.Generator().manual_seed(FAKE_PATTERN_SEED)
    coarse = torch.rand(num_classes, channels, 4, 4, generator=gen)
    return torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)


def fake_images(labels: torch.Tensor, channels: int, height: int, width: int, *, seed: int,
                noise: float = 0.2) -> torch.Tensor:
    """Images drawn from their class's pattern plus Gaussian noise: learnable, not uniform noise."""
    patterns = fake_class_patterns(channels, height, width)
    gen = torch.Generator().manual_seed(seed)
    noisy = patterns[labels] + noise * torch.randn(len(labels), channels, height, width, generator=gen)
    return noisy.clamp_(0, 1).mul_(255).round_().to(torch.uint8)


def load_fake(channels: int, height: int, width: int, seed: int = 0) -> ImageTensors:
    labels = torch.arange(FAKE_IMAGES) % len(FAKE_CLASSES)
    return ImageTensors(fake_images(labels, channels, height, width, seed=seed), labels, list(FAKE_CLASSES))


# ---------------------------------------------------------------------------- torchvision built-ins
def _torchvision_class(name: str, verify_checksums: bool) -> type:
    """torchvision's own class for a built-in. CIFAR10 checks each file's md5 against the
    official archive's; with `verify_checksums` off we use a subclass whose file lists carry no
    md5, so torchvision still checks every file is present and reads them with its own code
    (a re-packed or test copy in the same format). MNIST's classes only check presence anyway."""
    import torchvision.datasets as tvd

    if name == "cifar10":
        if verify_checksums:
            return tvd.CIFAR10

        class UnverifiedCIFAR10(tvd.CIFAR10):
            train_list: ClassVar = [[file, None] for file, _ in tvd.CIFAR10.train_list]
            test_list: ClassVar = [[file, None] for file, _ in tvd.CIFAR10.test_list]
            meta: ClassVar = {**tvd.CIFAR10.meta, "md5": None}

        return UnverifiedCIFAR10
    return {"mnist": tvd.MNIST, "fashion_mnist": tvd.FashionMNIST}[name]


def open_torchvision(name: str, root: Path, *, download: bool, verify_checksums: bool = True,
                     train: bool = True) -> Any:
    """A built-in's split as torchvision's own dataset object (its files, format and checks), indexable
    image by image; DatasetUnavailable, saying where its files go, when it cannot be opened."""
    cls = _torchvision_class(name, verify_checksums)
    try:
        return cls(root=str(root), train=train, download=download)
    except Exception as exc:
        where = BUILTIN_TORCHVISION[name].expected_files(root)
        how = "downloading failed" if download else "downloading is off (TORCHYARD_ALLOW_DOWNLOAD=false)"
        raise DatasetUnavailable(f"dataset {name} is not available: {exc}. Put its files at {where} "
                                 f"({how}).") from exc


def load_torchvision(name: str, root: Path, channels: int, height: int, width: int, *,
                     download: bool, verify_checksums: bool = True, train: bool = True,
                     resize_size: int | None = None) -> ImageTensors:
    """Read a built-in's training (or test) split through torchvision's dataset class (its format,
    its checks)."""
    dataset = open_torchvision(name, root, download=download, verify_checksums=verify_checksums, train=train)
    data = dataset.data if isinstance(dataset.data, np.ndarray) else dataset.data.numpy()
    labels = torch.as_tensor(np.asarray(dataset.targets), dtype=torch.int64)
    return ImageTensors(_arrays_to_tensor(data, channels, height, width, resize_size), labels,
                        list(dataset.classes))


def _arrays_to_tensor(data: np.ndarray, channels: int, height: int, width: int,
                      resize_size: int | None = None) -> torch.Tensor:
    """N×H×W(×C) uint8 → N×C×H×W at the target spec, through the same PIL transform as /predict."""
    native_channels = 1 if data.ndim == 3 else data.shape[3]
    if data.shape[1:3] == (height, width) and native_channels == channels and resize_size is None:
        chw = data[:, None] if data.ndim == 3 else data.transpose(0, 3, 1, 2)
        return torch.from_numpy(np.ascontiguousarray(chw))
    out = np.empty((len(data), channels, height, width), dtype=np.uint8)
    for i, array in enumerate(data):
        out[i] = image_to_array(Image.fromarray(array), channels, height, width, resize_size)
    return torch.from_numpy(out)


# ---------------------------------------------------------------------------- uploaded image folders
def load_image_folder(root: Path, channels: int, height: int, width: int, resize_size: int | None = None, *,
                      should_stop: Callable[[], str | None] | None = None,
                      wait_limit_s: float | None = None, device_decode: DeviceDecode | None = None) -> ImageTensors:
    """An extracted `<class>/<image>` folder at one input spec, decoded once by all the worker's cores
    (worker/data/dataset_decode.py) and cached beside it (`.<id>.cache/<spec>-t<transform>.pt`).

    Workers that need the same spec at the same time (two GPUs of one host) take an exclusive lock
    per spec: one decodes, the others wait and read its file; the kernel drops the lock with a
    holder that dies. A waiter polls the lock (`LOCK_POLL_S`) rather than block in the kernel, so
    that it asks `should_stop` meanwhile (a job cancelled while it waits raises `StopJob` and ends
    at once) and gives up after `wait_limit_s` (`DecodeWaitExpired`, naming the lock): a holder that
    is alive but stuck (frozen, its disk hung) never holds a job for ever. A cache written by an
    older transform (worker/data/image_array.TRANSFORM_VERSION) is not read: it is decoded again and the
    old file removed.

    The job that decoded the set does not wait for its cache: it returns the decoded array itself
    (as a tensor, no copy) while a thread of its own (`CacheWriter`) writes the file, holding the
    lock until the file is in place, so a waiting worker still reads it instead of decoding again.
    The file is written to a temporary name, fsynced and renamed (core/storage.atomic_path): a
    reader only ever opens the final name, so a writer killed mid-write (a SIGKILLed worker, a
    power loss) leaves at most a temporary file, never a cache that a later job trusts; the next
    decode of the spec removes such leftovers under the lock (no live writer can own them then).

    `device_decode`: the JPEGs nvJPEG takes decoded on that device, the rest by the pool meanwhile
    (worker/data/device_dataset_decode.py); None, the pool alone. The rows are the same contract's,
    within JPEG_TOLERANCE, so the cache's name does not say which decoder wrote it."""
    spec = InputSpec(channels, height, width, resize_size)
    folder = root.parent / f".{root.name}.cache"
    cache = folder / f"{spec.name}-t{TRANSFORM_VERSION}.pt"
    if cache.exists():
        return _read_cache(cache)
    folder.mkdir(parents=True, exist_ok=True)
    # Closed exactly once: here, or by the writer once it is handed over (a second close of the
    # number could close whatever another thread opened on it since).
    lock = _exclusive(folder / f"{spec.name}.lock", f"dataset {root.name} at {spec.name}", should_stop, wait_limit_s)
    held = True
    try:
        if cache.exists():  # decoded by another worker while this one waited
            _release(lock)
            held = False
            return _read_cache(cache)
        for leftover in folder.glob(f".{cache.name}.*.tmp"):  # a killed writer's: no live one holds the lock
            leftover.unlink(missing_ok=True)
        tensors = _decode_folder(root, spec, device_decode)
        stale = [p for p in [folder / f"{spec.name}.pt", *folder.glob(f"{spec.name}-t*.pt")] if p != cache]
        CacheWriter.start(cache, tensors, stale, lock, root)
        held = False  # the writer's now
        return tensors
    finally:
        if held:
            _release(lock)


def _decode_folder(root: Path, spec: InputSpec, device_decode: DeviceDecode | None) -> ImageTensors:
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files = [(path, label) for label, name in enumerate(classes) for path in sorted((root / name).iterdir())]
    workers = usable_cores()
    where = f" and {device_decode.device}" if device_decode is not None else ""
    log.info("decoding %d files of %s at %s on %d processes%s", len(files), root, spec.name, workers, where)
    paths = [path for path, _ in files]
    try:
        decoded = (decode_files(paths, spec, workers=workers) if device_decode is None
                   else decode_files_on_device(paths, spec, workers, device_decode))
    except DecodeFailed as exc:
        raise DatasetUnavailable(f"dataset at {root}: {exc}") from exc
    if not len(decoded.kept):
        raise DatasetUnavailable(f"dataset at {root} holds no readable images")
    labels = torch.tensor([files[i][1] for i in decoded.kept], dtype=torch.int64)
    return ImageTensors(torch.from_numpy(decoded.images), labels, classes, decoded.report)


class CacheWriter:
    """Writes a decoded set's cache behind the job that decoded it, then releases the spec's lock.

    A thread that is not a daemon: an interpreter that exits normally finishes the file first. Its
    images are the job's own tensor, which nothing writes to (the trainer copies its batches out
    of it), so the file holds what the job trained on."""

    _running: ClassVar[list[threading.Thread]] = []
    _guard = threading.Lock()

    @classmethod
    def start(cls, cache: Path, tensors: ImageTensors, stale: list[Path], lock: int, source: Path) -> None:
        thread = threading.Thread(target=cls._write, args=(cache, tensors, stale, lock, source),
                                  name="dataset-cache-writer")
        with cls._guard:
            cls._running[:] = [t for t in cls._running if t.is_alive()]
            cls._running.append(thread)
        thread.start()

    @classmethod
    def wait(cls, timeout: float | None = None) -> None:
        """Until every cache this process started writing is in place (or could not be written)."""
        with cls._guard:
            running = list(cls._running)
        for thread in running:
            thread.join(timeout)

    @staticmethod
    def _write(cache: Path, tensors: ImageTensors, stale: list[Path], lock: int, source: Path) -> None:
        try:
            with atomic_path(cache) as tmp:
                torch.save({"images": tensors.images, "labels": tensors.labels, "classes": tensors.classes}, tmp)
            for older in stale:
                older.unlink(missing_ok=True)
            # The job may have ended, and its dataset been deleted (which removes the source and
            # then this folder), while the file was written: checked after the file is in place, so
            # either this sees the source gone or the deletion's own removal comes after the file.
            if not source.exists():
                shutil.rmtree(cache.parent, ignore_errors=True)
        except Exception:  # a full disk: the set is decoded again by the next job that needs it
            log.exception("could not write the decoded set's cache %s", cache)
        finally:
            _release(lock)  # releases the lock: a waiting worker now finds the file (or decodes)


def _read_cache(path: Path) -> ImageTensors:
    saved = torch.load(path, weights_only=True)
    return ImageTensors(saved["images"], saved["labels"], list(saved["classes"]))


def _exclusive(lock: Path, what: str, should_stop: Callable[[], str | None] | None,
               wait_limit_s: float | None) -> int:
    """An open descriptor holding an exclusive lock on `lock`; `_release` closes it and the lock.
    While another process holds it: tried again every LOCK_POLL_S, `should_stop` asked each time
    (StopJob with its reason), DecodeWaitExpired past `wait_limit_s` (None: no limit)."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = None if wait_limit_s is None else time.monotonic() + wait_limit_s
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # held by another worker (or this one's cache writer): decoding it
                pass
            if not waiting:
                waiting = True
                log.info("waiting for another worker's decode of %s (lock %s)", what, lock)
            if should_stop is not None and (reason := should_stop()) is not None:
                raise StopJob(reason)
            if deadline is not None and time.monotonic() >= deadline:
                raise DecodeWaitExpired(
                    f"waited {wait_limit_s:g} s for another worker to decode {what}, and it still holds the lock "
                    f"({lock}): if that worker is stuck, stop it and submit again; a set that takes longer to "
                    f"decode needs a larger TORCHYARD_DECODE_LOCK_WAIT_S")
            time.sleep(LOCK_POLL_S)
    except BaseException:
        os.close(fd)
        raise
    with _held_guard:
        _held_locks.add(fd)
    return fd


def _release(fd: int) -> None:
    with _held_guard:
        _held_locks.discard(fd)
        os.close(fd)


# An flock belongs to the open file, so a process forked while a lock is held (a batch predict
# job's DataLoader forks its decoders; the cache writer may still hold the lock of the set the
# previous job decoded) would hold it too, until it exits, and a worker waiting for that spec
# would wait for it. The child closes its copies at once; exec'd children never get them
# (os.open's descriptors are not inheritable).
_held_locks: set[int] = set()
_held_guard = threading.Lock()


def _close_held_locks_in_child() -> None:
    for fd in _held_locks:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_locks.clear()
    _held_guard.release()


os.register_at_fork(before=_held_guard.acquire, after_in_parent=_held_guard.release,
                    after_in_child=_close_held_locks_in_child)


# The `fake` set's "test split" for evaluations: the same class patterns, noise drawn from a seed
# no training job uses by default.
FAKE_TEST_SEED = 2_147_483_647


def load_dataset(record: DatasetRecord, settings: Settings, channels: int, height: int, width: int, *,
                 seed: int = 0, resize_size: int | None = None, split: Literal["train", "test"] = "train",
                 should_stop: Callable[[], str | None] | None = None, device: str | None = None) -> ImageTensors:
    """A dataset's images at the model's input. split="test": torchvision's test split of a built-in,
    fresh noise for `fake`; an upload has one split, all of its images (`evaluation_split`). A job
    passes its stop check: it is asked while the job waits for another worker's decode of the set;
    and its torch device: an upload's first decode uses it as TORCHYARD_DECODE says (DeviceDecode)."""
    if record.kind == "fake":
        return load_fake(channels, height, width, seed=FAKE_TEST_SEED if split == "test" else seed)
    if record.kind == "torchvision":
        return load_torchvision(record.id, settings.builtin_data_dir, channels, height, width,
                                download=settings.allow_download, verify_checksums=settings.verify_builtin_checksums,
                                train=split == "train", resize_size=resize_size)
    return load_image_folder(settings.datasets_dir / record.id, channels, height, width, resize_size,
                             should_stop=should_stop, wait_limit_s=settings.decode_lock_wait_s,
                             device_decode=DeviceDecode.chosen(settings, device))


def evaluation_split(record: DatasetRecord) -> Literal["test", "all"]:
    """What an evaluation on `record` measures: a built-in's test split, or all of an upload."""
    return "all" if record.kind == "upload" else "test"


def split(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded train/validation index split."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    _, n_val = split_sizes(n, val_fraction)  # the sizes the API checked at submit
    return order[n_val:], order[:n_val]
