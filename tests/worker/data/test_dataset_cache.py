"""A decoded set's cache (worker/data/datasets.py): one decode per spec across workers that wait on its lock,
written behind the job, never trusted half-written, gone with its set, its lock held by nothing else.
Real processes, killed and frozen where the fault needs them."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

from tests.datagen import one_by_one, write_photo_set
from tests.support import REPO, hold_flock
from worker.data.datasets import CacheWriter, DecodeWaitExpired, load_image_folder
from worker.data.image_array import TRANSFORM_VERSION
from worker.runtime.job_context import StopJob

LOADER = r"""
import hashlib, logging, sys, time
from pathlib import Path
from worker.data.datasets import load_image_folder
if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    data = load_image_folder(Path(sys.argv[1]), 3, 224, 224)
    print(hashlib.sha256(data.images.numpy().tobytes() + data.labels.numpy().tobytes()).hexdigest(), flush=True)
    if sys.argv[2:] == ["train"]:  # a job goes on with its data while its cache is written
        time.sleep(600)
"""


@pytest.fixture
def start_loader() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start a worker's first job on a set, in a process of its own; any left at the end are killed
    (a failed test may leave one stopped)."""
    started: list[subprocess.Popen] = []

    def start(root: Path, *args: str) -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", LOADER, str(root), *args], cwd=REPO,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return started[-1]

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.communicate()


def wait_for_line(stream: IO[str], text: str) -> None:
    for line in stream:
        if text in line:
            return
    raise AssertionError(f"the process ended without logging {text!r}")


WAITING = "waiting for another worker's decode"  # what a loader logs once it finds the spec's lock held


@pytest.fixture
def hold_lock() -> Iterator[Callable[[Path], subprocess.Popen]]:
    """Another worker that holds a spec's lock and never lets go (stuck mid-decode): a process that
    takes the flock and sleeps (tests/support.hold_flock). Killed at the end."""
    started: list[subprocess.Popen] = []

    def hold(lock: Path) -> subprocess.Popen:
        started.append(hold_flock(lock))
        return started[-1]

    yield hold
    for process in started:
        process.kill()
        process.communicate()


def decoding_processes(pid: int, timeout: float = 30) -> list[psutil.Process]:
    """`pid`'s descendants once its decode pool runs (the forkserver, and its children the pool)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        descendants = psutil.Process(pid).children(recursive=True)
        if any(p.ppid() != pid for p in descendants):
            return descendants
        time.sleep(0.01)
    raise AssertionError("the decode pool did not start")


def test_two_workers_decode_a_set_once_and_a_killed_one_leaves_nothing(
        tmp_path: Path, start_loader: Callable[..., subprocess.Popen]) -> None:
    """Two first jobs on the same set and spec: the second waits for the first and reads its file
    (decoded once). A first job SIGKILLed while it decodes leaves no decoding process behind and no
    cache; the next one decodes the set itself."""
    root = tmp_path / "ds"
    files = write_photo_set(root, per_class=60)
    expected = one_by_one(files, 3, 224, 224)
    digest = hashlib.sha256(expected.tobytes() + np.repeat([0, 1], 60).astype(np.int64).tobytes()).hexdigest()

    first = start_loader(root)
    wait_for_line(first.stderr, "decoding 120 files")
    first.send_signal(signal.SIGSTOP)  # holding the lock, its cache not written
    second = start_loader(root)
    wait_for_line(second.stderr, WAITING)
    first.send_signal(signal.SIGCONT)
    outputs = [process.communicate(timeout=120) for process in (first, second)]
    assert [out.strip() for out, _ in outputs] == [digest, digest]
    assert "decoding" not in outputs[1][1]  # the second read the first's file

    for cache in (root.parent / ".ds.cache").glob("*.pt"):
        cache.unlink()
    doomed = start_loader(root)
    wait_for_line(doomed.stderr, "decoding 120 files")
    decoders = decoding_processes(doomed.pid)
    doomed.kill()
    doomed.wait()
    _, alive = psutil.wait_procs(decoders, timeout=30)
    assert not alive, f"decoding processes outlived their worker: {alive}"
    assert not list((root.parent / ".ds.cache").glob("*.pt"))
    third = start_loader(root)
    out, err = third.communicate(timeout=120)
    assert out.strip() == digest and "decoding 120 files" in err


def test_a_cache_unreadable_after_the_wait_fails_with_its_own_error(
        tmp_path: Path, start_loader: Callable[..., subprocess.Popen]) -> None:
    """A worker that waited for the spec's lock, then cannot read the file it finds (not a torch
    file), fails with that read's error: its lock's descriptor is closed once, not again after the
    read (which raised EBADF over the real error, or closed what another thread had opened since)."""
    root = tmp_path / "ds"
    write_photo_set(root, per_class=2)
    folder = tmp_path / ".ds.cache"
    folder.mkdir()
    holder = os.open(folder / "3x224x224.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another worker, decoding the set
    try:
        waiter = start_loader(root)
        wait_for_line(waiter.stderr, WAITING)
        (folder / f"3x224x224-t{TRANSFORM_VERSION}.pt").write_bytes(b"not a torch file")
    finally:
        os.close(holder)
    _, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 1 and "UnpicklingError" in err, err[-2000:]
    assert "Bad file descriptor" not in err and "During handling" not in err, err[-2000:]  # the one error


def test_a_job_waiting_behind_a_stuck_decode_stops_when_told_and_gives_up_past_its_limit(
        tmp_path: Path, hold_lock: Callable[[Path], subprocess.Popen]) -> None:
    """Another process holds the spec's lock and never releases it. The waiting job asks its stop
    check while it waits and leaves with that reason (cancelled: StopJob, the runner ends the job
    `cancelled`); without a stop, it fails past its limit naming the lock, and never decodes."""
    root = tmp_path / "ds"
    write_photo_set(root, per_class=2)
    lock = tmp_path / ".ds.cache" / "3x224x224.lock"
    holder = hold_lock(lock)
    asked: list[float] = []

    def cancelled_on_the_third_look() -> str | None:
        asked.append(time.monotonic())
        return "cancelled" if len(asked) >= 3 else None

    with pytest.raises(StopJob) as stopped:
        load_image_folder(root, 3, 224, 224, should_stop=cancelled_on_the_third_look, wait_limit_s=600)
    assert stopped.value.reason == "cancelled" and len(asked) == 3
    with pytest.raises(DecodeWaitExpired, match=r"waited 0\.5 s for another worker to decode dataset ds at 3x224x224") as expired:
        load_image_folder(root, 3, 224, 224, should_stop=lambda: None, wait_limit_s=0.5)
    assert str(lock) in str(expired.value) and "TORCHYARD_DECODE_LOCK_WAIT_S" in str(expired.value)
    assert holder.poll() is None  # the lock was never released: both left while it was held
    assert not list(lock.parent.glob("*.pt")) and not list(lock.parent.glob("*.tmp"))  # nothing decoded
    open_files = {Path(f.path) for f in psutil.Process().open_files()}
    assert lock not in open_files  # each wait closed its descriptor


def test_a_cache_half_written_by_a_killed_worker_is_never_read(
        tmp_path: Path, start_loader: Callable[..., subprocess.Popen]) -> None:
    """A first job has its data before its cache is on disk (a thread writes it); SIGKILLed while the
    file is half-written, it leaves a temporary file and no cache: the next job decodes the set again,
    gets every image right, and removes the leftover."""
    root = tmp_path / "ds"
    files = write_photo_set(root, per_class=100)
    expected = one_by_one(files, 3, 224, 224)
    digest = hashlib.sha256(expected.tobytes() + np.repeat([0, 1], 100).astype(np.int64).tobytes()).hexdigest()
    folder = root.parent / ".ds.cache"
    cache = folder / f"3x224x224-t{TRANSFORM_VERSION}.pt"

    doomed = start_loader(root, "train")
    deadline = time.monotonic() + 120
    partial: list[Path] = []
    while not partial and doomed.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            partial = [p for p in folder.glob(f".{cache.name}.*.tmp") if p.stat().st_size > 0]
    doomed.send_signal(signal.SIGSTOP)  # frozen mid-write, then killed where it stands
    assert partial, "the cache was never seen being written"
    written = partial[0].stat().st_size
    doomed.kill()
    doomed.communicate()
    assert not cache.exists(), "the kill landed after the rename: the file was whole; no half-written one to test"
    assert partial[0].exists() and written > 0  # a cache begun, under its temporary name only
    assert doomed.returncode == -signal.SIGKILL

    again = start_loader(root)
    out, err = again.communicate(timeout=120)
    assert out.strip() == digest and "decoding 200 files" in err  # decoded again, not read from the leftover
    assert cache.exists() and not list(folder.glob("*.tmp"))
    saved = torch.load(cache, weights_only=True)
    assert np.array_equal(saved["images"].numpy(), expected)


def test_a_set_deleted_while_its_cache_is_written_leaves_no_cache(tmp_path: Path) -> None:
    """The job has its images and may end, and its dataset be deleted (the source folder first),
    while the cache is still being written behind it: no decoded copy of a deleted set stays on disk."""
    root = tmp_path / "ds"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(100):
            Image.new("RGB", (8, 8), (i, 2 * i, 255 - i)).save(root / label / f"{i}.png")
    data = load_image_folder(root, 3, 512, 512)  # ~150 MB to write: still writing when the set goes
    assert len(data.labels) == 200
    subprocess.run(["rm", "-rf", str(root)], check=True)
    CacheWriter.wait()
    assert not (tmp_path / ".ds.cache").exists()
    assert list(tmp_path.iterdir()) == []


def test_a_process_forked_while_the_cache_is_written_does_not_hold_the_sets_lock(tmp_path: Path) -> None:
    """A fork while the writer holds the spec's lock (a batch predict job's DataLoader forks its
    decoders): once the file is in place the lock is free for another worker, child alive or not."""
    root = tmp_path / "ds"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(100):
            Image.new("RGB", (8, 8), (i, 2 * i, 255 - i)).save(root / label / f"{i}.png")
    load_image_folder(root, 3, 512, 512)  # ~150 MB to write: the writer holds the lock meanwhile
    child = os.fork()
    if child == 0:  # a forked decoder: alive well past the write
        time.sleep(30)
        os._exit(0)
    try:
        CacheWriter.wait()
        lock = tmp_path / ".ds.cache" / "3x512x512.lock"
        probe = subprocess.run([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
                                "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", str(lock)],
                               capture_output=True, text=True, timeout=30)
        assert probe.returncode == 0, probe.stderr
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
