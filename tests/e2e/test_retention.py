"""Retention through real API processes: DELETE /jobs/{id}, and the cleanup two API processes
share (a Redis lock), which removes what expired and what crashes left behind, and never what a
queued job needs."""

from __future__ import annotations

import io
import os
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from core import keys
from tests.support import Processes, free_port, own_api, png_bytes, wait_until

pytestmark = pytest.mark.e2e

DAY_S = 86_400


def _zip(classes: int = 2, per_class: int = 3) -> bytes:
    import numpy as np

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for c in range(classes):
            for i in range(per_class):
                archive.writestr(f"c{c}/{i}.png", png_bytes(np.full((8, 8, 3), 40 * c + i, dtype=np.uint8)))
    return buffer.getvalue()


@pytest.fixture
def two_apis(clean_redis_url: str, tmp_path: Path) -> Iterator[dict]:
    """Two API processes on one Redis and data dir, no worker (jobs stay queued), cleaning every
    second: finished jobs kept ~9 s, their events ~1 s, unused uploads ~1 s."""
    data_dir = tmp_path / "data"
    procs = Processes(clean_redis_url, data_dir, tmp_path / "logs", TORCHYARD_CLEANUP_INTERVAL_S="1",
                      TORCHYARD_KEEP_FAILED_JOBS_DAYS=str(9 / DAY_S), TORCHYARD_KEEP_JOB_EVENTS_DAYS=str(1 / DAY_S),
                      TORCHYARD_KEEP_UNUSED_DATASETS_DAYS=str(1 / DAY_S))
    ports = [free_port(), free_port()]
    for port in ports:  # both start at once: starting one is slow on a loaded host
        procs.api(port)
    first, second = (f"http://127.0.0.1:{port}" for port in ports)
    for base in (first, second):
        wait_until(lambda base=base: httpx.get(f"{base}/healthz").status_code == 200, timeout=90, what="an API")
    client = httpx.Client(base_url=first, timeout=60)
    try:
        yield {"client": client, "second": second, "procs": procs, "data_dir": data_dir}
    finally:
        client.close()
        procs.stop_all()


def _aged(path: Path, seconds: float) -> Path:
    then = time.time() - seconds
    for child in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(child, (then, then))
    return path


def _event_names(base: str, job_id: str) -> list[str]:
    with httpx.stream("GET", f"{base}/jobs/{job_id}/events", timeout=30) as response:
        return [line.split(": ", 1)[1] for line in response.iter_lines() if line.startswith("event: ")]


def test_delete_and_cleanup_keep_what_queued_jobs_need(two_apis: dict) -> None:
    client, data_dir = two_apis["client"], two_apis["data_dir"]
    used = client.post("/datasets", files={"file": ("u.zip", _zip(), "application/zip")}).json()["id"]
    unused = client.post("/datasets", files={"file": ("n.zip", _zip(), "application/zip")}).json()["id"]
    queued = client.post("/jobs", json={"model": "cifar_net", "dataset": used, "epochs": 1}).json()["id"]
    done = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()["id"]
    assert client.post(f"/jobs/{done}/cancel").json()["status"] == "cancelled"

    # DELETE: a queued job is refused (cancel first), an unknown one is 404.
    refused = client.delete(f"/jobs/{queued}")
    assert refused.status_code == 409 and "cancel it first" in refused.json()["detail"]
    assert client.delete("/jobs/nosuchjob").status_code == 404

    # What crashes leave behind, an hour and more old, next to fresh files of the same kinds.
    datasets, checkpoints = data_dir / "datasets", data_dir / "checkpoints"
    (datasets / ".upload-dead.zip").write_bytes(b"x")
    stale = [_aged(datasets / ".upload-dead.zip", 2 * 3600)]
    (datasets / ".ds0dead.partial" / "c0").mkdir(parents=True)
    (datasets / ".ds0dead.partial" / "c0" / "1.png").write_bytes(b"x")
    stale.append(_aged(datasets / ".ds0dead.partial", 2 * 3600))
    (datasets / ".dsgone.cache").mkdir()
    (datasets / ".dsgone.cache" / "3x32x32.pt").write_bytes(b"x")
    stale.append(_aged(datasets / ".dsgone.cache", 2 * 3600))
    (checkpoints / "0orphanjob").mkdir(parents=True)
    (checkpoints / "0orphanjob" / "model.pt").write_bytes(b"x")
    stale.append(_aged(checkpoints / "0orphanjob", 2 * 3600))
    (checkpoints / done).mkdir(parents=True)
    stale.append(checkpoints / done / "resume.pt")
    stale[-1].write_bytes(b"x")  # a cancelled job's: nothing will resume it
    fresh = datasets / ".upload-inflight.zip"
    fresh.write_bytes(b"x")

    # The cancelled job's events shrink to its terminal status, then the job goes; the unused upload
    # goes; every stale file goes.
    base = str(client.base_url).rstrip("/")
    wait_until(lambda: _event_names(base, done) == ["status"], timeout=60, what="the events to be trimmed")
    wait_until(lambda: not any(p.exists() for p in stale), timeout=60, what="the stale files to go")
    wait_until(lambda: client.get(f"/jobs/{done}").status_code == 404, timeout=60, what="the expired job to go")
    wait_until(lambda: client.get(f"/datasets/{unused}").status_code == 404, timeout=60, what="the unused upload")
    assert not (checkpoints / done).exists() and not (datasets / unused).exists()

    # What a queued job needs stays: the job, its dataset (record and files); a fresh temp file stays.
    assert client.get(f"/jobs/{queued}").json()["status"] == "queued"
    assert client.get(f"/datasets/{used}").status_code == 200 and (datasets / used).is_dir()
    assert fresh.exists()
    # Cancelled, it is deleted on request: record, events and files.
    client.post(f"/jobs/{queued}/cancel")
    (checkpoints / queued).mkdir(parents=True, exist_ok=True)
    assert client.delete(f"/jobs/{queued}").status_code == 204
    assert client.get(f"/jobs/{queued}").status_code == 404
    assert client.get(f"/jobs/{queued}/events").status_code == 404
    assert not (checkpoints / queued).exists()
    assert client.get(f"/jobs/{queued}", headers={}).status_code == 404
    assert httpx.get(f"{two_apis['second']}/jobs/{queued}").status_code == 404

    procs = two_apis["procs"]
    for proc in procs.procs:
        assert proc.poll() is None
        assert "cleanup failed" not in procs.log(proc)


def test_a_failed_cleanup_says_why_and_is_tried_again_soon(clean_redis_url: str, tmp_path: Path) -> None:
    """A pass that fails (here: a dataset record no version of torchyard wrote, in Redis) is logged with
    its reason on the ERROR line, and its lock is shortened to the retry delay: the next pass comes a
    minute later, not a cleanup interval (an hour) later."""
    client = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    client.set(keys.dataset("dsbroken"), "{not json")
    client.sadd(keys.DATASETS_INDEX, "dsbroken")
    with own_api(clean_redis_url, tmp_path, TORCHYARD_CLEANUP_INTERVAL_S="3600",
                 TORCHYARD_KEEP_UNUSED_DATASETS_DAYS="30") as api:
        procs = api["procs"]
        said = wait_until(lambda: next((line for line in procs.log(procs.procs[0]).splitlines()
                                        if "the retention cleanup failed" in line), None),
                          timeout=60, what="the failed pass's log line")
        assert "ERROR" in said and "ValidationError" in said and "runs again in 60 s" in said, said
        assert 0 < client.pttl(keys.RETENTION_LOCK) <= 60_000  # not the hour the pass took the lock for
