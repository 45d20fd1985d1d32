"""Faults the service must survive, with real processes on real Redis: workers SIGKILLed mid-job
until the job runs out of attempts, a corrupt resume checkpoint, a Redis restart (embedded,
AOF), an API restart under an SSE client, a NaN loss and a corrupt final checkpoint."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from app.embedded_redis import EmbeddedRedis
from tests.support import Processes, free_port, png_bytes, wait_for_job, wait_until
from worker.data import fake_images

pytestmark = pytest.mark.e2e

TERMINAL = {"succeeded", "failed", "cancelled"}


def _pattern_png(label: int) -> bytes:
    image = fake_images(torch.tensor([label]), 3, 32, 32, seed=4242)[0]
    return png_bytes(image.permute(1, 2, 0).numpy())


def _submit(client: httpx.Client, epochs: int, **params) -> str:
    created = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": epochs, **params})
    assert created.status_code == 202, created.text
    return created.json()["id"]


def _job(client: httpx.Client, job_id: str) -> dict:
    return client.get(f"/jobs/{job_id}").json()


def _running(client: httpx.Client, job_id: str, attempt: int) -> dict:
    return wait_until(lambda: (j := _job(client, job_id))["status"] == "running" and j["attempts"] == attempt and j,
                      timeout=90, what=f"job {job_id} running its attempt {attempt}")


@pytest.fixture
def own(clean_redis_url: str, tmp_path: Path) -> Iterator[dict]:
    """An API of its own on a flushed database, short leases and two attempts; workers started by the test."""
    procs = Processes(clean_redis_url, tmp_path / "data", tmp_path / "logs",
                      TORCHYARD_LEASE_TTL_S="2", TORCHYARD_MAX_ATTEMPTS="2")
    client = httpx.Client(base_url=procs.ready_api(), timeout=60)
    try:
        yield {"procs": procs, "client": client, "data_dir": tmp_path / "data"}
    finally:
        client.close()
        procs.stop_all()


def test_killed_workers_exhaust_attempts_and_a_corrupt_resume_fails_clearly(own: dict) -> None:
    """Three CPU workers under distinct node names (so they may run side by side), each job's
    worker SIGKILLed mid-run: a job that keeps killing its worker fails after
    TORCHYARD_MAX_ATTEMPTS=2; a job whose resume.pt was corrupted before its redelivery fails
    with a clear error naming the file (we do not silently restart it from scratch)."""
    procs, client = own["procs"], own["client"]
    checkpoints = own["data_dir"] / "checkpoints"
    workers = {f"fx{k}": procs.worker("cpu", name=f"fx{k}", TORCHYARD_NODE_NAME=f"fx{k}") for k in range(3)}

    def kill_runner_of(job: dict) -> None:
        procs.stop(workers.pop(job["device"].split("/")[0]), signal.SIGKILL)

    corrupt = _submit(client, 30)
    doomed = _submit(client, 200)
    wait_until(lambda: len(_job(client, corrupt)["metrics"]) >= 1 and (checkpoints / corrupt / "resume.pt").exists(),
               timeout=180, what="a first epoch and its resume.pt")
    first_run = _running(client, doomed, 1)
    kill_runner_of(_job(client, corrupt))
    kill_runner_of(first_run)
    resume = checkpoints / corrupt / "resume.pt"
    resume.write_bytes(resume.read_bytes()[: resume.stat().st_size // 2])

    # The last worker sweeps both expired leases; whichever job it takes first, `doomed` ends up
    # running its second attempt there. Kill that one too; a fresh worker sweeps it to `failed`.
    second_run = _running(client, doomed, 2)
    kill_runner_of(second_run)
    workers["fx3"] = procs.worker("cpu", name="fx3", TORCHYARD_NODE_NAME="fx3")

    failed = wait_for_job(client, doomed, TERMINAL, timeout=120)
    assert failed["status"] == "failed" and failed["attempts"] == 2, failed
    assert "gave up after 2 attempts" in failed["error"], failed["error"]
    # Each delivery ran at most once: the stream shows attempts 1 and 2 starting, nothing more.
    running_attempts = [e["attempts"] for kind, e in _events(client, doomed)
                        if kind == "status" and e.get("status") == "running"]
    assert running_attempts == [1, 2]

    broken = wait_for_job(client, corrupt, TERMINAL, timeout=120)
    assert broken["status"] == "failed" and broken["attempts"] == 2, broken
    assert "resume.pt" in broken["error"] and "cannot be read" in broken["error"], broken["error"]
    assert workers["fx3"].poll() is None


def _events(client: httpx.Client, job_id: str, last_event_id: str | None = None) -> list[tuple[str, dict]]:
    return [(kind, data) for _, kind, data in _read_sse(client, job_id, last_event_id)]


def _read_sse(client: httpx.Client, job_id: str, last_event_id: str | None = None,
              stop_after: int | None = None) -> list[tuple[str, str, dict]]:
    """(id, event, data) triples; stops at the stream's end, or after `stop_after` events."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    out: list[tuple[str, str, dict]] = []
    current: dict[str, str] = {}
    with client.stream("GET", f"/jobs/{job_id}/events", headers=headers, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line:
                if "id" in current:
                    out.append((current["id"], current["event"], json.loads(current["data"])))
                    if stop_after and len(out) >= stop_after:
                        return out
                current = {}
                continue
            key, _, value = line.partition(": ")
            current[key] = value
    return out


def test_redis_and_api_restarts_lose_nothing(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    procs = Processes(url, tmp_path / "data", tmp_path / "logs")
    port = free_port()
    procs.worker("cpu")
    api = procs.api(port)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=90, what="API and worker")
        job = _submit(client, 200)

        # --- the API dies under an SSE client mid-job; a new one continues from Last-Event-ID ----
        first = _read_sse(client, job, stop_after=3)
        assert _job(client, job)["status"] == "running"
        procs.stop(api, signal.SIGKILL)
        api = procs.api(port)
        wait_until(lambda: client.get("/healthz").status_code == 200, timeout=60, what="the restarted API")
        rest = _read_sse(client, job, last_event_id=first[-1][0], stop_after=2)
        assert client.post(f"/jobs/{job}/cancel").status_code == 202
        tail = _read_sse(client, job, last_event_id=rest[-1][0])
        whole = _read_sse(client, job)
        assert [e[0] for e in first + rest + tail] == [e[0] for e in whole], "events lost or repeated"
        assert tail[-1][1] == "status" and tail[-1][2]["status"] == "cancelled"

        uploaded = client.post("/datasets", data={"name": "tiny"}, files={"file": ("d.zip", _tiny_zip(), "application/zip")})
        assert uploaded.status_code == 201, uploaded.text
        dataset = uploaded.json()["id"]

        # --- Redis restarts (SIGTERM flushes the AOF; same directory, same socket) ----------------
        server.stop()
        server.start()
        listed = wait_until(lambda: client.get("/jobs").json()["jobs"], timeout=30, what="the job list after restart")
        assert [j["id"] for j in listed] == [job] and listed[0]["status"] == "cancelled"
        assert client.get(f"/datasets/{dataset}").json()["num_images"] == 4

        # Workers reconnect by themselves: the Celery consumer takes a new job, the inference thread answers.
        after = wait_for_job(client, _submit(client, 1, dataset=dataset), TERMINAL, timeout=180)
        assert after["status"] == "succeeded", after["error"]
        answer = wait_until(lambda: (r := client.post("/predict", data={"job_id": after["id"]},
                                                      files={"file": ("p.png", _pattern_png(2), "image/png")}))
                            .status_code == 200 and r, timeout=30, what="a prediction after the restart")
        assert answer.json()["results"][0]["predictions"][0]["label"] in ("c1", "c2")
    finally:
        client.close()
        procs.stop_all()
        server.stop()


def _tiny_zip() -> bytes:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for label in (1, 2):
            for k in range(2):
                archive.writestr(f"c{label}/{k}.png", _pattern_png(label))
    return buffer.getvalue()


def test_nan_loss_and_corrupt_checkpoint_fail_clearly_and_the_worker_goes_on(stack: dict) -> None:
    client = stack["client"]
    # SGD at the largest allowed learning rate blows cifar_net up within the first epoch.
    nan = wait_for_job(client, _submit(client, 3, optimizer="sgd", learning_rate=10.0), TERMINAL)
    assert nan["status"] == "failed", nan
    assert "loss" in nan["error"] and any(w in nan["error"] for w in ("nan", "inf")), nan["error"]

    # The same worker takes the next job; its final checkpoint, truncated on disk, gives a clear 409.
    good = wait_for_job(client, _submit(client, 1), TERMINAL)
    assert good["status"] == "succeeded", good["error"]
    model = stack["data_dir"] / "checkpoints" / good["id"] / "model.pt"
    model.write_bytes(model.read_bytes()[:1000])
    answer = client.post("/predict", data={"job_id": good["id"]}, files={"file": ("p.png", _pattern_png(1), "image/png")})
    assert answer.status_code == 409, answer.text
    assert "model.pt" in answer.json()["detail"]
    assert stack["worker"].poll() is None
