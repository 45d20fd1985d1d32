"""Faults on one host the service must survive, with real processes on real Redis: workers
SIGKILLed mid-job until the job runs out of attempts, a corrupt resume checkpoint, a worker
restarted after a crash taking its job back at once, a Redis restart (embedded, AOF), an API
restart under an SSE client, a NaN loss and a corrupt final checkpoint. (On a cluster of two
"hosts": test_faults_cluster.py.)"""

from __future__ import annotations

import concurrent.futures
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.embedded_redis import EmbeddedRedis
from tests.support import (
    TERMINAL,
    Processes,
    free_port,
    get_job,
    job_events,
    own_api,
    pattern_png,
    pattern_zip,
    read_sse,
    submit_cifar,
    wait_for_job,
    wait_until,
)

pytestmark = pytest.mark.e2e


def _running(client: httpx.Client, job_id: str, attempt: int) -> dict:
    return wait_until(lambda: (j := get_job(client, job_id))["status"] == "running" and j["attempts"] == attempt and j,
                      timeout=90, what=f"job {job_id} running its attempt {attempt}")


@pytest.fixture
def own(clean_redis_url: str, tmp_path: Path) -> Iterator[dict]:
    """An API of its own on a flushed database, short leases and two attempts; workers started by the test."""
    with own_api(clean_redis_url, tmp_path, TORCHYARD_LEASE_TTL_S="2", TORCHYARD_MAX_ATTEMPTS="2") as stack:
        yield stack


def test_killed_workers_exhaust_attempts_and_a_corrupt_resume_fails_clearly(own: dict) -> None:
    """Three CPU workers under distinct node names (so they may run side by side), each job's
    worker SIGKILLed mid-run: a job that keeps killing its worker fails after
    TORCHYARD_MAX_ATTEMPTS=2; a job whose resume state was corrupted before its redelivery fails
    with a clear error naming the file (we do not silently restart it from scratch)."""
    procs, client = own["procs"], own["client"]
    checkpoints = own["data_dir"] / "checkpoints"
    workers = {f"fx{k}": procs.worker("cpu", name=f"fx{k}", TORCHYARD_NODE_NAME=f"fx{k}") for k in range(3)}

    def kill_runner_of(job: dict) -> None:
        procs.stop(workers.pop(job["device"].split("/")[0]), signal.SIGKILL)

    corrupt = submit_cifar(client, 30)
    doomed = submit_cifar(client, 200)
    wait_until(lambda: len(get_job(client, corrupt)["metrics"]) >= 1, timeout=180, what="a first recorded epoch")
    first_run = _running(client, doomed, 1)
    kill_runner_of(get_job(client, corrupt))
    kill_runner_of(first_run)
    # Each delivery keeps its resume states under deliveries/<token>/; damage every one there is.
    states = list((checkpoints / corrupt).glob("deliveries/*/resume-*.pt"))
    assert states, "no resume state recorded with the first epoch"
    for resume in states:
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
    running_attempts = [e["attempts"] for kind, e in job_events(client, doomed)
                        if kind == "status" and e.get("status") == "running"]
    assert running_attempts == [1, 2]

    broken = wait_for_job(client, corrupt, TERMINAL, timeout=120)
    assert broken["status"] == "failed" and broken["attempts"] == 2, broken
    assert "resume-" in broken["error"] and "cannot be read" in broken["error"], broken["error"]
    assert workers["fx3"].poll() is None


def test_a_worker_restarted_after_a_crash_takes_its_job_back_at_once(clean_redis_url: str, tmp_path: Path) -> None:
    """SIGKILL the worker mid-job, restart it under the same name (as `up` does): its predecessor's
    pid is gone, so the job is requeued at once and resumes, long before its 120 s lease would have
    expired (so only that path can pass, even on a slow host: two worker starts fit well inside it).
    A worker of another host that starts meanwhile leaves the job alone (leases rule there)."""
    with own_api(clean_redis_url, tmp_path, TORCHYARD_LEASE_TTL_S="120") as own:
        procs, client = own["procs"], own["client"]
        crashed = procs.worker("cpu", name="ha-first", TORCHYARD_NODE_NAME="ha")
        job_id = submit_cifar(client, 300, batch_size=8)
        wait_until(lambda: len(get_job(client, job_id)["metrics"]) >= 1, timeout=180, what="a first recorded epoch")
        procs.stop(crashed, signal.SIGKILL)
        killed_at = time.monotonic()

        other_host = procs.worker("cpu", name="hb", TORCHYARD_NODE_NAME="hb")
        wait_until(lambda: any(d["id"] == "hb/cpu" and d["status"] == "idle"
                               for d in client.get("/devices").json()["devices"]), timeout=120, what="hb serving")
        time.sleep(1.0)
        held = get_job(client, job_id)
        assert held["status"] == "running" and held["attempts"] == 1 and held["device"] == "ha/cpu", held

        procs.worker("cpu", name="ha-second", TORCHYARD_NODE_NAME="ha")
        resumed = _running(client, job_id, 2)
        assert time.monotonic() - killed_at < 100, "taken back by the lease's expiry, not at once"
        assert resumed["device"] in ("ha/cpu", "hb/cpu")
        wait_until(lambda: (get_job(client, job_id)["resumed_from_epoch"] or 0) >= 1, timeout=60,
                   what="the second attempt to resume after its recorded epochs")
        assert client.post(f"/jobs/{job_id}/cancel").status_code == 202
        wait_for_job(client, job_id, TERMINAL, timeout=60)  # its event stream ends: read it whole
        reasons = [data.get("reason", "") for kind, data in job_events(client, job_id)
                   if kind == "status" and data.get("status") == "queued"]
        assert reasons[1:] == ["its worker process (cpu@ha) died"], reasons
        assert other_host.poll() is None


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
        job = submit_cifar(client, 200)

        # --- the API dies under an SSE client mid-job; a new one continues from Last-Event-ID ----
        first = read_sse(client, job, stop_after=3)
        assert get_job(client, job)["status"] == "running"
        procs.stop(api, signal.SIGKILL)
        api = procs.api(port)
        wait_until(lambda: client.get("/healthz").status_code == 200, timeout=60, what="the restarted API")
        rest = read_sse(client, job, last_event_id=first[-1][0], stop_after=2)
        assert client.post(f"/jobs/{job}/cancel").status_code == 202
        tail = read_sse(client, job, last_event_id=rest[-1][0])
        whole = read_sse(client, job)
        assert [e[0] for e in first + rest + tail] == [e[0] for e in whole], "events lost or repeated"
        assert tail[-1][1] == "status" and tail[-1][2]["status"] == "cancelled"

        uploaded = client.post("/datasets", data={"name": "tiny"}, files={"file": ("d.zip", pattern_zip(), "application/zip")})
        assert uploaded.status_code == 201, uploaded.text
        dataset = uploaded.json()["id"]

        # --- Redis restarts (SIGTERM flushes the AOF; same directory, same socket) ----------------
        server.stop()
        server.start()
        listed = wait_until(lambda: client.get("/jobs").json()["jobs"], timeout=30, what="the job list after restart")
        assert [j["id"] for j in listed] == [job] and listed[0]["status"] == "cancelled"
        assert client.get(f"/datasets/{dataset}").json()["num_images"] == 4

        # Workers reconnect by themselves: the Celery consumer takes a new job, the inference thread answers.
        after = wait_for_job(client, submit_cifar(client, 1, dataset=dataset), TERMINAL, timeout=180)
        assert after["status"] == "succeeded", after["error"]
        # The restarted Redis has no scripts cached: the first predictions arrive as a burst, whose
        # queueing scripts the API sends in one pipeline (NOSCRIPT for all, loaded, run again once).
        # Each is sent once: a 503 here would be a request lost to the empty script cache.
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=30, what="a live worker")

        def predict_once(n: int) -> str:
            answer = client.post("/predict", data={"job_id": after["id"]},
                                 files={"file": (f"p{n}.png", pattern_png(2), "image/png")})
            assert answer.status_code == 200, answer.text
            return answer.json()["results"][0]["filename"]

        with concurrent.futures.ThreadPoolExecutor(12) as burst:
            assert sorted(burst.map(predict_once, range(12))) == sorted(f"p{n}.png" for n in range(12))
    finally:
        client.close()
        procs.stop_all()
        server.stop()


def test_nan_loss_and_corrupt_checkpoint_fail_clearly_and_the_worker_goes_on(stack: dict) -> None:
    client = stack["client"]
    # SGD at the largest allowed learning rate blows cifar_net up within the first epoch.
    nan = wait_for_job(client, submit_cifar(client, 3, optimizer="sgd", learning_rate=10.0), TERMINAL)
    assert nan["status"] == "failed", nan
    assert "loss" in nan["error"] and any(w in nan["error"] for w in ("nan", "inf")), nan["error"]

    # The same worker takes the next job; its final checkpoint, truncated on disk, gives a clear 409.
    good = wait_for_job(client, submit_cifar(client, 1), TERMINAL)
    assert good["status"] == "succeeded", good["error"]
    model = stack["data_dir"] / "checkpoints" / good["id"] / "model.pt"
    model.write_bytes(model.read_bytes()[:1000])
    answer = client.post("/predict", data={"job_id": good["id"]}, files={"file": ("p.png", pattern_png(1), "image/png")})
    assert answer.status_code == 409, answer.text
    assert "model.pt" in answer.json()["detail"]
    assert stack["worker"].poll() is None
