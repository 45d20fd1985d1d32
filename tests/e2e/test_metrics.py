"""GET /metrics against the real stack: Prometheus text that a Prometheus parser reads, with the
request counters, /predict latency, batch sizes, queue depths, jobs by status, devices and the
throughput of a running job."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import REPO, wait_for_job, wait_until

pytestmark = pytest.mark.e2e


def scrape(client: httpx.Client) -> dict[tuple[str, frozenset], float]:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _succeeded_job(client: httpx.Client) -> dict:
    """A job of this test's own (other tests may leave theirs with a deliberately broken checkpoint)."""
    job = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
    done = wait_for_job(client, job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    return done


def test_metrics_exposition(stack: dict) -> None:
    client = stack["client"]
    trained = _succeeded_job(client)
    image = (REPO / "examples" / "pattern_3.png").read_bytes()
    for _ in range(3):
        answer = client.post("/predict", data={"job_id": trained["id"]},
                             files={"file": ("p3.png", image, "image/png")})
        assert answer.status_code == 200, answer.text
    assert client.get("/jobs/not-a-job-123").status_code == 404
    # Refused by the front gate on its headers, before any route runs: still counted under the route.
    assert client.post("/predict", content=b"hello", headers={"content-type": "text/plain"}).status_code == 415

    # A long job runs (its epoch throughput shows) while a second one waits in Celery's queue.
    running = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 200, "patience": 0}).json()
    waiting = None
    try:
        wait_for_job(client, running["id"], {"running"}, timeout=60)
        waiting = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
        device = client.get(f"/jobs/{running['id']}").json()["device"]

        def throughput_shows() -> dict | None:
            samples = scrape(client)
            rate = value(samples, "torchyard_job_images_per_second", job=running["id"], model="cifar_net",
                         device=device)
            return samples if rate and rate > 0 else None

        samples = wait_until(throughput_shows, timeout=120, interval=0.5, what="the running job's images/s")
        assert value(samples, "torchyard_redis_up") == 1
        assert value(samples, "torchyard_jobs", status="running") == 1
        assert value(samples, "torchyard_jobs", status="queued") >= 1
        assert value(samples, "torchyard_jobs", status="succeeded") >= 1
        assert value(samples, "torchyard_train_queue_depth", queue="train") >= 1
        assert value(samples, "torchyard_train_queue_depth", queue="train.cuda") == 0
        assert value(samples, "torchyard_predict_queue_depth", device=device) == 0
        assert value(samples, "torchyard_device_up", device=device, type="cpu") == 1
        assert value(samples, "torchyard_device_busy", device=device, type="cpu") == 1
        assert value(samples, "torchyard_device_memory_total_bytes", device=device, type="cpu") > 0
        assert value(samples, "torchyard_device_memory_used_bytes", device=device, type="cpu") > 0
    finally:
        for job in (waiting, running):
            if job:
                client.post(f"/jobs/{job['id']}/cancel")
    wait_for_job(client, running["id"], {"cancelled", "failed", "succeeded"})

    # Requests count under their route template, never under a raw id.
    assert value(samples, "torchyard_http_requests_total", method="GET", route="/jobs/{job_id}", status="404") >= 1
    assert value(samples, "torchyard_http_requests_total", method="POST", route="/predict", status="200") >= 3
    assert value(samples, "torchyard_http_requests_total", method="POST", route="/predict", status="415") >= 1
    assert not any("not-a-job-123" in str(labels) for _, labels in samples)
    assert value(samples, "torchyard_predict_latency_seconds_count") >= 3
    assert value(samples, "torchyard_predict_latency_seconds_sum") > 0

    # Batch sizes come from the worker's heartbeat: every image of the 3 calls was in some batch.
    def batches_reported() -> dict | None:
        now = scrape(client)
        return now if (value(now, "torchyard_predict_images_total", device=trained["device"]) or 0) >= 3 else None

    samples = wait_until(batches_reported, timeout=30, interval=0.5, what="inference stats in the heartbeat")
    count = value(samples, "torchyard_predict_batch_size_count", device=trained["device"])
    assert count >= 1
    assert value(samples, "torchyard_predict_batch_size_bucket", device=trained["device"], le="+Inf") == count
    assert value(samples, "torchyard_predict_batch_size_sum", device=trained["device"]) >= 3
